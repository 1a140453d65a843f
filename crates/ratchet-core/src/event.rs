//! Observation events as the core produces them. The store assigns each a per-session `seq`
//! when it is written; nothing is published before its transaction commits.

use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    RunCreated,
    RunStatus,
    StepCommitted,
    Activity,
    AssistantDelta,
    AssistantMessage,
    /// The reasoning a provider returned with a model call, committed with its step.
    AssistantReasoning,
    ToolCall,
    ToolResult,
    /// An attempt of a call ended with nobody knowing whether it took effect.
    ToolOutcomeUnknown,
    ModelError,
    ReconciliationRequired,
    ReconciliationDecided,
    ApprovalRequired,
    ApprovalDecided,
    RunResumed,
    MessageSteered,
    ContextCompacted,
    SubagentStarted,
    SubagentFinished,
    CompletionBlocked,
    /// A run parked on a `wait` call, until the time it names.
    TimerSet,
    /// A run's `wait` ended: its time came, or input for its session arrived.
    TimerWoke,
    InboxReserved,
    InboxPending,
    InboxLeased,
    InboxConsumed,
    InboxReleased,
    InboxDeadLettered,
    InboxSuperseded,
    InboxRequeued,
    InboxDiscarded,
    SignalEmitted,
    SessionClosed,
    RunFinished,
}

impl EventKind {
    pub const ALL: [EventKind; 35] = [
        EventKind::RunCreated,
        EventKind::RunStatus,
        EventKind::StepCommitted,
        EventKind::Activity,
        EventKind::AssistantDelta,
        EventKind::AssistantMessage,
        EventKind::AssistantReasoning,
        EventKind::ToolCall,
        EventKind::ToolResult,
        EventKind::ToolOutcomeUnknown,
        EventKind::ModelError,
        EventKind::ReconciliationRequired,
        EventKind::ReconciliationDecided,
        EventKind::ApprovalRequired,
        EventKind::ApprovalDecided,
        EventKind::RunResumed,
        EventKind::MessageSteered,
        EventKind::ContextCompacted,
        EventKind::SubagentStarted,
        EventKind::SubagentFinished,
        EventKind::CompletionBlocked,
        EventKind::TimerSet,
        EventKind::TimerWoke,
        EventKind::InboxReserved,
        EventKind::InboxPending,
        EventKind::InboxLeased,
        EventKind::InboxConsumed,
        EventKind::InboxReleased,
        EventKind::InboxDeadLettered,
        EventKind::InboxSuperseded,
        EventKind::InboxRequeued,
        EventKind::InboxDiscarded,
        EventKind::SignalEmitted,
        EventKind::SessionClosed,
        EventKind::RunFinished,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::RunCreated => "run.created",
            EventKind::RunStatus => "run.status",
            EventKind::StepCommitted => "step.committed",
            EventKind::Activity => "activity",
            EventKind::AssistantDelta => "assistant.delta",
            EventKind::AssistantMessage => "assistant.message",
            EventKind::AssistantReasoning => "assistant.reasoning",
            EventKind::ToolCall => "tool.call",
            EventKind::ToolResult => "tool.result",
            EventKind::ToolOutcomeUnknown => "tool.outcome_unknown",
            EventKind::ModelError => "model.error",
            EventKind::ReconciliationRequired => "reconciliation.required",
            EventKind::ReconciliationDecided => "reconciliation.decided",
            EventKind::ApprovalRequired => "approval.required",
            EventKind::ApprovalDecided => "approval.decided",
            EventKind::RunResumed => "run.resumed",
            EventKind::MessageSteered => "message.steered",
            EventKind::ContextCompacted => "context.compacted",
            EventKind::SubagentStarted => "subagent.started",
            EventKind::SubagentFinished => "subagent.finished",
            EventKind::CompletionBlocked => "completion.blocked",
            EventKind::TimerSet => "timer.set",
            EventKind::TimerWoke => "timer.woke",
            EventKind::InboxReserved => "inbox.reserved",
            EventKind::InboxPending => "inbox.pending",
            EventKind::InboxLeased => "inbox.leased",
            EventKind::InboxConsumed => "inbox.consumed",
            EventKind::InboxReleased => "inbox.released",
            EventKind::InboxDeadLettered => "inbox.dead_lettered",
            EventKind::InboxSuperseded => "inbox.superseded",
            EventKind::InboxRequeued => "inbox.requeued",
            EventKind::InboxDiscarded => "inbox.discarded",
            EventKind::SignalEmitted => "signal.emitted",
            EventKind::SessionClosed => "session.closed",
            EventKind::RunFinished => "run.finished",
        }
    }

    pub fn parse(text: &str) -> Option<EventKind> {
        EventKind::ALL.into_iter().find(|k| k.as_str() == text)
    }
}

/// An event before the store has given it a `seq`.
#[derive(Debug, Clone, PartialEq)]
pub struct EventDraft {
    pub kind: EventKind,
    pub payload: Value,
}

impl EventDraft {
    pub fn new(kind: EventKind, payload: Value) -> Self {
        EventDraft { kind, payload }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_kind_names_round_trip() {
        for kind in EventKind::ALL {
            assert_eq!(EventKind::parse(kind.as_str()), Some(kind));
        }
        assert_eq!(EventKind::parse("nope"), None);
    }
}
