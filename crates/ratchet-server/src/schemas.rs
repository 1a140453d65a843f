//! Schemas of the OpenAPI document that the derive cannot write: ids by their shape, and the
//! names of statuses and event kinds. Each is built from the core's own definition (an id's
//! prefix and length, a status's list of names), so the document cannot drift from what the
//! server parses and writes.
//!
//! The types here are only names for the document (`#[schema(value_type = …)]`); nothing is
//! ever built from them.

use std::borrow::Cow;

use ratchet_core::{
    ApprovalId, DeliveryStatus, EventKind, InboxStatus, RunId, RunStatus, ScheduleId, SessionId,
    WebhookId,
};
use ratchet_store::ApprovalStatus;
use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
use utoipa::{PartialSchema, ToSchema};

/// The schema of one kind of id: its prefix, then 1 to `max_suffix` letters, digits or `-`
/// (what `ratchet_core`'s ids accept).
fn id_schema(prefix: &str, max_suffix: usize, what: &str) -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(format!("^{prefix}[A-Za-z0-9-]{{1,{max_suffix}}}$")))
        .description(Some(format!(
            "A {what} id: `{prefix}` then 1 to {max_suffix} letters, digits or `-`."
        )))
        .into()
}

/// A string that is one of `names`.
fn names_schema<'a>(names: impl IntoIterator<Item = &'a str>, description: &str) -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(names))
        .description(Some(description))
        .into()
}

macro_rules! id_schema {
    ($schema:ident, $id:ident, $what:literal) => {
        #[doc = concat!("The document's name for a ", $what, " id (`", stringify!($id), "`).")]
        pub struct $schema;

        impl PartialSchema for $schema {
            fn schema() -> RefOr<Schema> {
                id_schema($id::PREFIX, $id::MAX_SUFFIX_LEN, $what)
            }
        }

        impl ToSchema for $schema {
            fn name() -> Cow<'static, str> {
                Cow::Borrowed(stringify!($id))
            }
        }
    };
}

macro_rules! names_schema {
    ($schema:ident, $name:literal, $names:expr, $description:literal) => {
        #[doc = concat!("The document's name for `", $name, "`: ", $description)]
        pub struct $schema;

        impl PartialSchema for $schema {
            fn schema() -> RefOr<Schema> {
                names_schema($names, $description)
            }
        }

        impl ToSchema for $schema {
            fn name() -> Cow<'static, str> {
                Cow::Borrowed($name)
            }
        }
    };
}

id_schema!(SessionIdSchema, SessionId, "session");
id_schema!(RunIdSchema, RunId, "run");
id_schema!(ApprovalIdSchema, ApprovalId, "approval");
id_schema!(WebhookIdSchema, WebhookId, "webhook");
id_schema!(ScheduleIdSchema, ScheduleId, "schedule");

/// A message's id. A person's message has a `MessageId` (`msg_` and at most 64 letters, digits
/// or `-`); the messages a step writes are named after their run and step, so theirs may be
/// longer.
pub struct MessageIdSchema;

impl PartialSchema for MessageIdSchema {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some("^msg_[A-Za-z0-9-]+$"))
            .description(Some("A message id: `msg_` then letters, digits or `-`."))
            .into()
    }
}

impl ToSchema for MessageIdSchema {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("MessageId")
    }
}

names_schema!(
    RunStatusSchema,
    "RunStatus",
    RunStatus::ALL.iter().map(|status| status.as_str()),
    "what a run is doing, or how it ended."
);
names_schema!(
    SessionStatusSchema,
    "SessionStatus",
    RunStatus::ALL
        .iter()
        .map(|status| status.as_str())
        .chain(["idle", "archived"]),
    "`archived`, its active run's status, or `idle` (no active run)."
);
names_schema!(
    ApprovalStatusSchema,
    "ApprovalStatus",
    ApprovalStatus::ALL.iter().map(|status| status.as_str()),
    "`pending`, `decided`, `aborted`, or `cancelled` (its run ended unanswered)."
);
names_schema!(
    InboxStatusSchema,
    "InboxStatus",
    InboxStatus::ALL.iter().map(|status| status.as_str()),
    "where an inbox event stands (`dead_letter` for the dead letters)."
);
names_schema!(
    DeliveryStatusSchema,
    "DeliveryStatus",
    DeliveryStatus::ALL.iter().map(|status| status.as_str()),
    "where a webhook delivery stands (`dead_letter` for the dead letters)."
);
names_schema!(
    EventKindSchema,
    "EventKind",
    EventKind::ALL.iter().map(|kind| kind.as_str()),
    "the kind of a stored event."
);
