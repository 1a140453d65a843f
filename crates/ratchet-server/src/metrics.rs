//! `/metrics` in Prometheus format, and the health probes. Counters and histograms are
//! recorded where things happen (the worker, the store's writer, the event streams); gauges
//! of the store's contents are read at scrape time.

use std::sync::OnceLock;

use axum::extract::State;
use axum::response::IntoResponse;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde_json::json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::{ApiError, AppState};

#[derive(Clone)]
pub struct Metrics {
    handle: PrometheusHandle,
}

impl Metrics {
    /// The process-wide recorder, installed on first use (a process has one).
    pub fn install() -> Metrics {
        static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
        let handle = HANDLE.get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (an embedding program's): then this
            // handle renders what it can, and the embedder's recorder keeps the rest.
            let _ = metrics::set_global_recorder(recorder);
            handle
        });
        Metrics {
            handle: handle.clone(),
        }
    }
}

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(render))
        .routes(routes!(healthy))
        .routes(routes!(ready))
}

#[utoipa::path(
    get, path = "/metrics", tag = "operations",
    responses((status = 200, content_type = "text/plain", body = String,
               description = "Prometheus text format; needs no token")),
)]
async fn render(State(state): State<AppState>) -> Result<impl IntoResponse, ApiError> {
    let stats = state.coordinator.store().stats(now_ms()).await?;
    for status in ratchet_core::RunStatus::ALL {
        let count = stats
            .runs_by_status
            .iter()
            .find(|(s, _)| *s == status)
            .map_or(0, |(_, n)| *n);
        metrics::gauge!("ratchet_runs", "status" => status.as_str()).set(count as f64);
    }
    metrics::gauge!("ratchet_job_queue_depth", "state" => "ready").set(stats.ready_jobs as f64);
    metrics::gauge!("ratchet_job_queue_depth", "state" => "held").set(stats.held_jobs as f64);
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        state.metrics.handle.render(),
    ))
}

/// The process is up; needs no token.
#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, body = Object)))]
async fn healthy() -> axum::Json<serde_json::Value> {
    axum::Json(json!({"status": "ok"}))
}

/// Ready when the store answers; needs no token.
#[utoipa::path(
    get, path = "/readyz", tag = "operations",
    responses((status = 200, body = Object), (status = 500, body = crate::api::ErrorBody)),
)]
async fn ready(State(state): State<AppState>) -> Result<impl IntoResponse, ApiError> {
    state.coordinator.store().stats(now_ms()).await?;
    Ok(axum::Json(json!({"status": "ready"})))
}

pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
