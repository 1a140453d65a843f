//! Trace export over OTLP, configured by the standard `OTEL_*` variables: on when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, off
//! otherwise and when `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. The protocol
//! is `http/protobuf` (the default) or `grpc`; headers, timeout, service name, resource
//! attributes, sampler and batching follow their variables, read by the OpenTelemetry SDK.

use std::time::Duration;

use anyhow::{Context as _, bail};
use opentelemetry_otlp::SpanExporter;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;

/// How long spans still buffered at exit may take to leave.
const FLUSH_AT_EXIT: Duration = Duration::from_secs(5);

/// The installed exporter; dropping it sends what is still buffered.
pub struct Exporting(SdkTracerProvider);

impl Drop for Exporting {
    fn drop(&mut self) {
        if let Err(error) = self.0.shutdown_with_timeout(FLUSH_AT_EXIT) {
            tracing::warn!(%error, "could not export the last spans");
        }
    }
}

fn var(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .filter(|value| !value.trim().is_empty())
}

/// Installs the OTLP exporter when the environment asks for one. Must be called inside the
/// tokio runtime (the gRPC exporter's connection lives on it).
pub fn install() -> anyhow::Result<Option<Exporting>> {
    let endpoint =
        var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT"));
    let disabled = var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
        || var("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"));
    if endpoint.is_none() || disabled {
        return Ok(None);
    }
    let protocol = var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|| "http/protobuf".to_owned());
    let exporter = match protocol.as_str() {
        "http/protobuf" => SpanExporter::builder().with_http().build(),
        "grpc" => SpanExporter::builder().with_tonic().build(),
        other => bail!(
            "OTEL_EXPORTER_OTLP_PROTOCOL is {other:?}; expected \"http/protobuf\" or \"grpc\""
        ),
    }
    .context("cannot set up the OTLP trace exporter")?;
    let mut resource = Resource::builder();
    let named = var("OTEL_SERVICE_NAME").is_some()
        || var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| a.contains("service.name="));
    if !named {
        resource = resource.with_service_name("ratchet");
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_id_generator(ratchet_telemetry::enable())
        .with_resource(resource.build())
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    Ok(Some(Exporting(provider)))
}
