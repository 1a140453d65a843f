//! The spans of runs, steps, model calls and tool calls, following the OpenTelemetry GenAI
//! semantic conventions, made with the OpenTelemetry API. A process that exports none (no
//! `OTEL_EXPORTER_OTLP_ENDPOINT`) never calls `enable`, and makes none.
//!
//! A run's span (`invoke_agent`) cannot be held open across processes, and its steps may
//! run in several: so its id is derived from the run's id (`ratchet_core::trace`), each step
//! is made a child of that id wherever it runs, and the run's span itself is made — with
//! that id, from the run's creation to its end — by the process that commits its end. The
//! SDK picks span ids itself; `ChosenIds`, the id generator the exporting binary installs
//! (`enable`), lets this crate choose them for those spans. Until `enable`, every function
//! here returns at once.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{
    Span, SpanBuilder, SpanContext, SpanKind, Status, TraceContextExt, TraceFlags, TraceState,
    Tracer,
};
use opentelemetry::{Context, KeyValue, global};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator};
use ratchet_core::trace::{self, SpanId, TraceId};
use ratchet_core::{AgentState, Millis, ReplayPolicy, RunConfigSnapshot, StepJob, Usage};

/// The instrumentation scope of every span Ratchet makes.
pub const SCOPE: &str = "ratchet";

/// Whether prompts and completions go into spans: only when the operator asks
/// (`RATCHET_OTEL_CAPTURE_CONTENT=true`), since they may hold what must not leave.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capture {
    pub content: bool,
}

impl Capture {
    /// `RATCHET_OTEL_CAPTURE_CONTENT=true` captures content; anything else does not.
    pub fn from_env() -> Capture {
        Capture {
            content: std::env::var("RATCHET_OTEL_CAPTURE_CONTENT")
                .is_ok_and(|value| value.trim().eq_ignore_ascii_case("true")),
        }
    }
}

thread_local! {
    static CHOSEN: Cell<Option<(opentelemetry::TraceId, opentelemetry::SpanId)>> = const { Cell::new(None) };
}

/// Whether spans are made at all: off until `enable`, so that a process that exports
/// nothing spends nothing on them.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// Turns Ratchet's spans on, and returns the id generator the tracer provider that exports
/// them must be built with (the run and call spans' ids are chosen, see the module's doc).
pub fn enable() -> ChosenIds {
    ENABLED.store(true, Ordering::Relaxed);
    ChosenIds::default()
}

fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The SDK's id generator: random ids, except for the span being built by `build` with ids
/// of its choosing.
#[derive(Debug, Default)]
pub struct ChosenIds {
    random: RandomIdGenerator,
}

impl IdGenerator for ChosenIds {
    fn new_trace_id(&self) -> opentelemetry::TraceId {
        CHOSEN
            .with(Cell::get)
            .map_or_else(|| self.random.new_trace_id(), |(trace, _)| trace)
    }

    fn new_span_id(&self) -> opentelemetry::SpanId {
        CHOSEN
            .with(Cell::get)
            .map_or_else(|| self.random.new_span_id(), |(_, span)| span)
    }
}

/// Builds a span, with the ids `ids` when given (the trace's applies when there is no
/// parent: the SDK asks the id generator synchronously while it builds, on this thread).
/// Its attributes are made only when the span is recorded: without an exporter a step pays
/// for no text it would throw away.
fn build(
    builder: SpanBuilder,
    parent: &Context,
    ids: Option<(TraceId, SpanId)>,
    attributes: impl FnOnce() -> Vec<KeyValue>,
) -> global::BoxedSpan {
    if let Some((trace, span)) = ids {
        CHOSEN.with(|chosen| chosen.set(Some((otel_trace(trace), otel_span(span)))));
    }
    let mut span = global::tracer(SCOPE).build_with_context(builder, parent);
    CHOSEN.with(|chosen| chosen.set(None));
    if span.is_recording() {
        span.set_attributes(attributes());
    }
    span
}

fn otel_trace(id: TraceId) -> opentelemetry::TraceId {
    opentelemetry::TraceId::from_bytes(id.to_bytes())
}

fn otel_span(id: SpanId) -> opentelemetry::SpanId {
    opentelemetry::SpanId::from_bytes(id.to_bytes())
}

fn remote(trace: TraceId, span: SpanId) -> Context {
    Context::new().with_remote_span_context(SpanContext::new(
        otel_trace(trace),
        otel_span(span),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    ))
}

fn time(at: Millis) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(at).unwrap_or(0))
}

/// What a caller's span is known by: the run's span for each of its steps.
fn run_parent(state: &AgentState) -> Context {
    remote(trace::trace_id(state), trace::run_span_id(&state.run_id))
}

fn agent_name(config: &RunConfigSnapshot) -> Option<String> {
    config.agent.as_ref().map(|agent| agent.id.clone())
}

/// `gen_ai.provider.name` and `gen_ai.request.model` of a run's model.
fn provider_and_model(config: &RunConfigSnapshot) -> (String, String) {
    if let Some(settings) = &config.model_settings {
        return (settings.provider.clone(), settings.model.clone());
    }
    match config.model.split_once(':') {
        Some((provider, model)) => (format!("ratchet.{provider}"), model.to_owned()),
        None => ("ratchet".to_owned(), config.model.clone()),
    }
}

fn run_attributes(state: &AgentState) -> Vec<KeyValue> {
    let mut attributes = vec![KeyValue::new("ratchet.run_id", state.run_id.to_string())];
    if let Some(agent) = agent_name(&state.config) {
        attributes.push(KeyValue::new("gen_ai.agent.name", agent));
    }
    attributes
}

/// The span of one step: a child of its run's span, wherever the step runs. The returned
/// context holds it; model and tool calls made within are its children.
pub fn start_step(state: &AgentState, job: &StepJob) -> Context {
    if !enabled() {
        return Context::new();
    }
    let builder = SpanBuilder::from_name("step").with_kind(SpanKind::Internal);
    let parent = run_parent(state);
    let span = build(builder, &parent, None, || {
        let mut attributes = run_attributes(state);
        attributes.push(KeyValue::new("ratchet.step_index", job.step_index as i64));
        attributes.push(KeyValue::new("ratchet.attempt", i64::from(job.attempt)));
        attributes
    });
    parent.with_span(span)
}

/// Ends a step's span. How the step went is told by its children (a failed model or tool
/// call is an error) and by the run's span.
pub fn end_step(step: &Context) {
    step.span().end();
}

/// The span of a model call (`chat {model}`), a child of `step`.
pub fn start_chat(step: &Context, state: &AgentState) -> Context {
    if !enabled() {
        return step.clone();
    }
    let (provider, model) = provider_and_model(&state.config);
    let builder = SpanBuilder::from_name(format!("chat {model}")).with_kind(SpanKind::Client);
    let span = build(builder, step, None, || {
        let mut attributes = run_attributes(state);
        attributes.extend([
            KeyValue::new("gen_ai.operation.name", "chat"),
            KeyValue::new("gen_ai.provider.name", provider),
            KeyValue::new("gen_ai.request.model", model),
        ]);
        attributes
    });
    step.with_span(span)
}

/// Ends a model call's span with what it used, or as an error. With `capture`, the prompt
/// and the answer go in as `gen_ai.input.messages` and `gen_ai.output.messages`.
pub fn end_chat(
    chat: &Context,
    outcome: Result<&Usage, &str>,
    capture: Capture,
    content: impl FnOnce() -> (String, String),
) {
    let span = chat.span();
    if !span.is_recording() {
        return span.end();
    }
    match outcome {
        Ok(usage) => {
            span.set_attribute(KeyValue::new(
                "gen_ai.usage.input_tokens",
                usage.input_tokens as i64,
            ));
            span.set_attribute(KeyValue::new(
                "gen_ai.usage.output_tokens",
                usage.output_tokens as i64,
            ));
            if capture.content {
                let (input, output) = content();
                span.set_attribute(KeyValue::new("gen_ai.input.messages", input));
                span.set_attribute(KeyValue::new("gen_ai.output.messages", output));
            }
        }
        Err(error) => span.set_status(Status::error(error.to_owned())),
    }
    span.end();
}

/// What names a tool call in its span.
pub struct ToolCallSpan<'a> {
    pub tool: &'a str,
    pub call_id: &'a str,
    pub slot: u32,
    pub replay: ReplayPolicy,
}

/// The span of a tool call (`execute_tool {tool}`), a child of `step`. Its id is the one
/// `ratchet_core::trace::call_span_id` derives, so that a child run a delegating call starts
/// is created under it.
pub fn start_tool(
    step: &Context,
    state: &AgentState,
    job: &StepJob,
    call: ToolCallSpan<'_>,
) -> Context {
    if !enabled() {
        return step.clone();
    }
    let builder =
        SpanBuilder::from_name(format!("execute_tool {}", call.tool)).with_kind(SpanKind::Internal);
    let id = trace::call_span_id(&state.run_id, job.step_index, call.slot);
    let span = build(builder, step, Some((trace::trace_id(state), id)), || {
        let mut attributes = run_attributes(state);
        attributes.extend([
            KeyValue::new("gen_ai.operation.name", "execute_tool"),
            KeyValue::new("gen_ai.tool.name", call.tool.to_owned()),
            KeyValue::new("gen_ai.tool.call.id", call.call_id.to_owned()),
            KeyValue::new("ratchet.step_index", job.step_index as i64),
            KeyValue::new("ratchet.replay_policy", call.replay.as_str()),
        ]);
        attributes
    });
    step.with_span(span)
}

/// Ends a tool call's span, as an error when the call failed.
pub fn end_tool(tool: &Context, error: Option<&str>) {
    let span = tool.span();
    if let Some(error) = error {
        span.set_status(Status::error(error.to_owned()));
    }
    span.end();
}

/// Records the span of a run that has just ended (`invoke_agent {agent}`), from its
/// creation to `ended_at`, under the caller's or delegating call's span when it has one.
pub fn run_ended(state: &AgentState, ended_at: Millis) {
    if !enabled() {
        return;
    }
    let name = match agent_name(&state.config) {
        Some(agent) => format!("invoke_agent {agent}"),
        None => "invoke_agent".to_owned(),
    };
    let builder = SpanBuilder::from_name(name)
        .with_kind(SpanKind::Internal)
        .with_start_time(time(state.created_at));
    let parent = match &state.trace {
        Some(context) => remote(context.trace_id, context.parent_span_id),
        None => Context::new(),
    };
    let ids = (trace::trace_id(state), trace::run_span_id(&state.run_id));
    let mut span = build(builder, &parent, Some(ids), || {
        let (provider, model) = provider_and_model(&state.config);
        let mut attributes = run_attributes(state);
        attributes.extend([
            KeyValue::new("gen_ai.operation.name", "invoke_agent"),
            KeyValue::new("gen_ai.provider.name", provider),
            KeyValue::new("gen_ai.request.model", model),
            KeyValue::new("ratchet.status", state.status.to_string()),
            KeyValue::new("ratchet.steps", state.step_index as i64),
            KeyValue::new(
                "gen_ai.usage.input_tokens",
                state.counters.input_tokens as i64,
            ),
            KeyValue::new(
                "gen_ai.usage.output_tokens",
                state.counters.output_tokens as i64,
            ),
        ]);
        if let Some(reason) = &state.stop_reason {
            attributes.push(KeyValue::new("ratchet.stop_reason", reason.to_string()));
        }
        attributes
    });
    if state.status != ratchet_core::RunStatus::Completed {
        span.set_status(Status::error(state.status.to_string()));
    }
    span.end_with_timestamp(time(ended_at));
}

/// The `traceparent` header for a request made within `cx`'s span, when that span is
/// recorded (a tracer provider is installed and sampled it).
pub fn traceparent(cx: &Context) -> Option<String> {
    let span = cx.span();
    let context = span.span_context();
    (span.is_recording() && context.is_valid()).then(|| {
        format!(
            "00-{}-{}-{:02x}",
            context.trace_id(),
            context.span_id(),
            context.trace_flags().to_u8()
        )
    })
}
