//! The pure domain of Ratchet: ids, run state, status edges, phases, instructions, the Brain
//! and the functions that turn an executed instruction into the next committed state.
//!
//! This crate never performs I/O, never awaits, never reads the clock and never draws random
//! numbers: time and ids are passed in. Everything that *decides* lives here so that it can be
//! tested exhaustively without a runtime.

pub mod activity;
pub mod approval;
pub mod batch;
pub mod bounds;
pub mod brain;
pub mod completion;
pub mod delegation;
pub mod effect;
pub mod event;
pub mod fork;
pub mod id;
pub mod inbox;
pub mod message;
pub mod schedule;
pub mod state;
pub mod status;
pub mod step;
pub mod timer;
pub mod trace;
pub mod tree_budget;
pub mod webhook;

pub use activity::Activity;
pub use approval::{ApprovalAnswer, ApprovalCall, ApprovalPolicy, CallDecision, Verdict};
pub use brain::{Instruction, decide};
pub use completion::{Blocker, CompletionCriteria, CompletionProgress};
pub use delegation::{AgentProfile, AgentRef, DelegationConfig, Lineage, ToolDelegation};
pub use effect::{AfterUnknown, CallLimits, after_unknown};
pub use event::{EventDraft, EventKind};
pub use fork::{ForkEdit, ForkedFrom};
pub use id::{ApprovalId, IdError, MessageId, RunId, ScheduleId, SessionId, WebhookId};
pub use inbox::{CompletionPolicy, Delivery, InboxKind, InboxPolicy, InboxStatus};
pub use message::{Message, Origin, Role, ToolCall, ToolOutcome, Visibility};
pub use schedule::{CatchUp, Overlap, ScheduledSlot, SlotOutcome};
pub use state::{
    AgentState, BudgetExtension, BudgetKind, BudgetUse, CallProgress, Counters, HumanRequest,
    Limits, MemoryScope, ModelSettings, Pause, Prices, ReplayPolicy, RunConfigSnapshot,
    ToolCheckpoint, ToolSpec, UnknownCall,
};
pub use status::{IllegalEdge, RunStatus, StopReason};
pub use step::{ModelReply, Phase, StepJob, StepRecord, StepResult, Usage};
pub use timer::{Timer, WAIT_TOOL};
pub use trace::TraceContext;
pub use tree_budget::{TreeBudget, TreeSpend};
pub use webhook::{Backoff, DeliveryStatus};

/// Milliseconds since the Unix epoch. The core never reads the clock; callers pass this in.
pub type Millis = i64;
