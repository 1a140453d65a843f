//! Reloading what is active (`POST /v1/admin/reload`, and SIGHUP in the binary): prepare a
//! whole new `Active`, checked in full, then activate it in one swap — or keep the old one and
//! report every problem.
//!
//! One task owns the reloader and answers reloads one at a time, so two reloads never
//! interleave their prepare and activate steps. It never holds a lock across an `.await`:
//! activation is a single `send_replace` of the watch channel requests read from.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use ratchet_core::Millis;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::api::ErrorBody;
use crate::auth::Admin;
use crate::metrics::now_ms;
use crate::{Active, ApiError, AppState};

/// Reloads that may wait for the one in progress; more wait for room in the queue.
const QUEUE: usize = 8;

/// Reads the configuration and the catalog again and builds what would replace the active
/// set. Given by the program that assembles the server: only it knows where the settings come
/// from and how tools, models and catalogs are checked.
pub trait Reloader: Send + Sync + 'static {
    /// A new set, checked in full, or every problem found. It may block on files: it runs on
    /// a blocking thread.
    fn prepare(&self) -> Result<Prepared, Vec<String>>;

    /// The set made again from the configuration last activated, read from nowhere again:
    /// for when what it was checked against changed (the tools an MCP server offers). A
    /// reloader that keeps no configuration reloads.
    fn refresh(&self) -> Result<Prepared, Vec<String>> {
        self.prepare()
    }
}

impl<F> Reloader for F
where
    F: Fn() -> Result<Prepared, Vec<String>> + Send + Sync + 'static,
{
    fn prepare(&self) -> Result<Prepared, Vec<String>> {
        self()
    }
}

/// A new set ready to be activated.
#[derive(Debug)]
pub struct Prepared {
    pub active: Active,
    /// Settings that changed but take effect only when the process restarts (the listen
    /// address, the database, …), by their configuration key.
    pub restart_required: Vec<String>,
}

/// What a successful reload activated.
#[derive(Debug, Clone)]
pub struct Reloaded {
    pub active: Arc<Active>,
    pub restart_required: Vec<String>,
    pub reloaded_at: Millis,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "reload rejected, the previous configuration stays active ({} problem{}): {}",
        problems.len(),
        if problems.len() == 1 { "" } else { "s" },
        problems.join("; ")
    )]
    Rejected { problems: Vec<String> },
    #[error("the reload task has stopped (the server is shutting down); nothing was reloaded")]
    Stopped,
}

/// A handle on the reload task: each call waits for its own reload to be done.
#[derive(Clone)]
pub struct Reloads {
    requests: mpsc::Sender<Request>,
}

/// What a reload starts from.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// The configuration read again.
    Read,
    /// The configuration last activated.
    Activated,
}

type Request = (Source, oneshot::Sender<Result<Reloaded, Error>>);

impl Reloads {
    /// Starts the task that owns `reloader` and replaces what `active` holds; it ends when
    /// `shutdown` is cancelled. Must be called inside a tokio runtime.
    pub(crate) fn start(
        reloader: impl Reloader,
        active: Arc<watch::Sender<Arc<Active>>>,
        shutdown: CancellationToken,
    ) -> Reloads {
        let (requests, inbox) = mpsc::channel(QUEUE);
        tokio::spawn(serve_reloads(Arc::new(reloader), active, inbox, shutdown));
        Reloads { requests }
    }

    /// Prepares a new set and activates it, or reports why it was rejected (the old set stays
    /// active).
    pub async fn reload(&self) -> Result<Reloaded, Error> {
        self.request(Source::Read).await
    }

    /// Makes the active set again from the configuration last activated (see
    /// `Reloader::refresh`), in turn with reloads.
    pub async fn refresh(&self) -> Result<Reloaded, Error> {
        self.request(Source::Activated).await
    }

    async fn request(&self, source: Source) -> Result<Reloaded, Error> {
        let (answer, answered) = oneshot::channel();
        self.requests
            .send((source, answer))
            .await
            .map_err(|_| Error::Stopped)?;
        answered.await.map_err(|_| Error::Stopped)?
    }
}

async fn serve_reloads(
    reloader: Arc<dyn Reloader>,
    active: Arc<watch::Sender<Arc<Active>>>,
    mut inbox: mpsc::Receiver<Request>,
    shutdown: CancellationToken,
) {
    loop {
        let (source, answer) = tokio::select! {
            () = shutdown.cancelled() => return,
            request = inbox.recv() => match request {
                Some(request) => request,
                None => return,
            },
        };
        let preparing = Arc::clone(&reloader);
        let prepare = move || match source {
            Source::Read => preparing.prepare(),
            Source::Activated => preparing.refresh(),
        };
        let prepared = match tokio::task::spawn_blocking(prepare).await {
            Ok(prepared) => prepared,
            // A reloader that panics has a bug; it ends this task, and later reloads are
            // answered `Stopped`.
            Err(failed) => std::panic::resume_unwind(failed.into_panic()),
        };
        let outcome = match prepared {
            Ok(Prepared {
                active: new,
                restart_required,
            }) => {
                let new = Arc::new(new);
                active.send_replace(Arc::clone(&new));
                Ok(Reloaded {
                    active: new,
                    restart_required,
                    reloaded_at: now_ms(),
                })
            }
            Err(problems) => Err(Error::Rejected { problems }),
        };
        // The caller may have gone away; the reload happened all the same.
        let _ = answer.send(outcome);
    }
}

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(reload))
}

/// What is active after a reload.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReloadView {
    /// The catalog's agents in id order.
    pub agents: Vec<ActiveAgentView>,
    /// The model a run is frozen with when its session names no agent.
    pub model: String,
    /// Settings that changed but take effect only after a restart, by configuration key
    /// (`listen`, `db`, `workers`, `lease_ms`, `heartbeat_ms`, `poll_ms`, `gates`, `mcp`,
    /// `webhooks`, `models`); empty when nothing needs one.
    pub restart_required: Vec<String>,
    pub reloaded_at: Millis,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ActiveAgentView {
    pub id: String,
    /// The SHA-256 of its definition file as it was read; absent for an agent that was not
    /// read from a catalog file.
    pub hash: Option<String>,
}

impl From<Reloaded> for ReloadView {
    fn from(reloaded: Reloaded) -> ReloadView {
        let active = &reloaded.active;
        ReloadView {
            agents: (active.agents().iter())
                .map(|agent| ActiveAgentView {
                    id: agent.id.clone(),
                    hash: agent.config.agent.as_ref().map(|a| a.hash.clone()),
                })
                .collect(),
            model: active.run_template().model.clone(),
            restart_required: reloaded.restart_required,
            reloaded_at: reloaded.reloaded_at,
        }
    }
}

#[utoipa::path(
    post, path = "/v1/admin/reload", tag = "admin",
    responses(
        (status = 200, body = ReloadView, description = "The configuration and the catalog were read again, checked and activated whole; runs already created keep the configuration they were frozen with"),
        (status = 403, body = ErrorBody, description = "the token is not an administrator's (`[[tokens]] admin = true`)"),
        (status = 409, body = ErrorBody, description = "this server was assembled without a way to read its configuration again"),
        (status = 422, body = ErrorBody, description = "the new configuration or catalog has problems (`error.problems` lists every one); the previous one stays active"),
        (status = 503, body = ErrorBody, description = "the server is shutting down"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn reload(
    State(state): State<AppState>,
    _admin: Admin,
) -> Result<axum::Json<ReloadView>, ApiError> {
    let Some(reloads) = state.reloads() else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            "this server cannot reload: it was started without a configuration to read again",
        ));
    };
    match reloads.reload().await {
        Ok(reloaded) => Ok(axum::Json(reloaded.into())),
        Err(Error::Rejected { problems }) => Err(ApiError::unprocessable(format!(
            "reload rejected ({} problem{}); the previous configuration stays active",
            problems.len(),
            if problems.len() == 1 { "" } else { "s" },
        ))
        .with_problems(problems)),
        Err(stopped @ Error::Stopped) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            stopped.to_string(),
        )),
    }
}
