# Pydantic models of Ratchet's HTTP API, generated from its OpenAPI document by
# scripts/generate_models.py: change the server's schemas and run it again; never edit
# this file by hand.

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel


class ActiveAgentView(BaseModel):
    hash: Optional[str] = None
    """
    The SHA-256 of its definition file as it was read; absent for an agent that was not
    read from a catalog file.
    """
    id: str


class AgentView(BaseModel):
    """
    An agent of the server's catalog, as a session can name it.
    """

    approvals: list[dict[str, Any]]
    """
    Its tools whose calls wait for a person: `{"tool", "policy"}`, the policy `always` or
    `{"when_arguments": {argument: glob}}`.
    """
    delegates: list[str]
    """
    The agents its runs may delegate to, by id.
    """
    description: str
    hash: Optional[str] = None
    """
    The hash of the definition its runs are frozen from; absent for an agent that was not
    read from a catalog file.
    """
    id: str
    limits: dict[str, Any]
    """
    The limits its runs are frozen with (`max_steps`, `max_model_calls`, `max_tokens`,
    `max_duration_ms`, …; null for one not set).
    """
    model: str
    """
    The model spec its runs call.
    """
    tools: list[str]
    """
    The tools its runs are offered, by name.
    """


class ApprovalCallView(BaseModel):
    arguments: dict[str, Any]
    call_id: str
    decision: Optional[str] = None
    """
    `approve` or `deny` once decided (a call left out of a decision is approved).
    """
    name: str
    """
    The tool's name.
    """
    needs_approval: bool
    """
    False for a call held only because another call of its batch needs approval.
    """
    note: Optional[str] = None


class ApprovalId(RootModel[str]):
    root: str = Field(..., pattern="^apr_[A-Za-z0-9-]{1,85}$")
    """
    A approval id: `apr_` then 1 to 85 letters, digits or `-`.
    """


class ApprovalRequestBody2(BaseModel):
    """
    Either `decisions` (every call that needs approval, once) or `"abort": true`, which ends the run as cancelled by a human.
    """

    model_config = ConfigDict(
        extra="forbid",
    )
    abort: Literal[True]
    decisions: None = Field(None)


class BudgetView(BaseModel):
    """
    One budget of a run and what it used.
    """

    kind: str
    """
    `steps`, `model_calls`, `tool_calls`, `tokens` (input and output), `prompt_tokens`
    or `duration_ms` (time running, pauses left out).
    """
    limit: int = Field(..., ge=0)
    spent: bool
    """
    `used` has reached `limit`.
    """
    used: int = Field(..., ge=0)


class ContinueRequest(BaseModel):
    """
    Budget to add when continuing a failed run; each field is added to the run's limit of
    the same name (a run without such a limit stays without one).
    """

    model_config = ConfigDict(
        extra="forbid",
    )
    extra_duration_ms: Optional[int] = Field(None, ge=0)
    extra_model_calls: Optional[int] = Field(None, ge=0)
    extra_steps: Optional[int] = Field(None, ge=0)
    extra_tokens: Optional[int] = Field(None, ge=0)
    extra_tool_calls: Optional[int] = Field(None, ge=0)


class CreateSession(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
    )
    agent: Optional[str] = None
    """
    The agent that answers in this session: the id of an agent of the catalog
    (`GET /v1/agents`), or `default` (the same as leaving it out) for the server's own run
    configuration. Its runs are frozen with that agent's configuration.
    """
    metadata: Optional[dict[str, Any]] = None
    """
    Free-form JSON object kept with the session.
    """


class ErrorDetail(BaseModel):
    code: str
    """
    Stable machine-readable code: `bad_request`, `invalid_request`, `unauthorized`,
    `not_found`, `conflict`, `payload_too_large`, `unsupported_media_type`,
    `quota_exceeded`, `unavailable`, `internal`.
    """
    message: str
    problems: Optional[list[str]] = None
    """
    Every problem found, when one request can have several (a rejected reload); absent
    otherwise.
    """


class ForkEditRequest1(BaseModel):
    """
    The last user message at or before the step says this instead; what answered the old
    text is left out, and the fork calls the model first.
    """

    replace_user_message: str
    """
    The last user message at or before the step says this instead; what answered the old
    text is left out, and the fork calls the model first.
    """


class ForkedFromView(BaseModel):
    """
    Where a fork came from: its source run and the step of it the fork continues from.
    """

    run_id: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """
    step: int = Field(..., ge=0)


class MessageAccepted(BaseModel):
    message_id: str = Field(..., pattern="^msg_[A-Za-z0-9-]+$")
    """
    A message id: `msg_` then letters, digits or `-`.
    """
    run_id: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    The message's run; for a steering message, the active run it will join.
    """
    run_status: str
    """
    `running` when the run started at once, `queued` behind the session's active run (for
    a steering message, the active run's status).
    """
    steered: bool
    """
    True when the message waits to join the active run (`multitask: "steer"`).
    """


class MessageId(RootModel[str]):
    root: str = Field(..., pattern="^msg_[A-Za-z0-9-]+$")
    """
    A message id: `msg_` then letters, digits or `-`.
    """


class ModelMessageView(BaseModel):
    """
    A message as a model reads it.
    """

    content: str
    is_error: bool
    """
    A tool result whose call failed.
    """
    origin: str
    """
    `user`, `agent`, `continuation`, `steer` or `summary`.
    """
    role: str
    """
    `system`, `user`, `assistant` or `tool`.
    """
    tool_call_id: Optional[str] = None
    tool_calls: list[dict[str, Any]]
    visibility: str
    """
    `visible`, or `hidden` for what only the model reads.
    """


class OfferedToolView(BaseModel):
    description: str
    name: str
    parameters: dict[str, Any]
    """
    The JSON Schema of its arguments.
    """


class OperatorBody(BaseModel):
    """
    Who acts on a dead letter, for the record.
    """

    model_config = ConfigDict(
        extra="forbid",
    )
    by: Optional[str] = Field(
        None,
        max_length=200,
        min_length=1,
        pattern="^[^\\x00-\\x1f\\x7f-\\x9f]*[^\\s\\x00-\\x1f\\x7f-\\x9f][^\\x00-\\x1f\\x7f-\\x9f]*$",
    )
    """
    Who requeues or discards it: 1–200 characters, not only white space, no control
    characters; the caller's tenant when absent.
    """


class PageAgentView(BaseModel):
    """
    Every listing: a page of items and the cursor of the next page (null on the last).
    """

    items: list[AgentView]
    next_cursor: Optional[str] = None
    """
    An opaque cursor: pass it as `cursor` for the next page, unchanged. Null on the last
    page.
    """


class PauseView(BaseModel):
    run_id: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """
    status: str
    """
    `paused` when the run stopped at once (or was paused already), `pausing` while the
    step in flight finishes: its commit pauses the run.
    """


class ReconcileRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
    )
    call_id: str
    outcome: Literal["succeeded", "failed", "retry", "skip"]
    """
    A human's answer for a call whose outcome is unknown after a crash.
    """
    result: Optional[str] = None
    """
    What the call produced, for `succeeded` or `failed`.
    """


class ReplaceToolResult(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
    )
    call_id: str
    """
    A call of the batch pending at the step, or of one answered at or before it.
    """
    result: Any


class RequeuedView(BaseModel):
    """
    How many dead letters a bulk requeue put back.
    """

    requeued: int = Field(..., ge=0)


class ResumedView(BaseModel):
    run_id: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """
    status: str
    """
    `running`: the run's next step is enqueued (or, for a pause not reached yet, the run
    simply goes on).
    """


class RotateSecret(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
    )
    secret: Optional[str] = Field(
        None, max_length=256, min_length=16, pattern="^[!-~]{16,256}$"
    )
    """
    The new key, 16–256 printable ASCII characters without spaces; one is made when absent.
    """


class RotatedSecret(BaseModel):
    id: str = Field(..., pattern="^whk_[A-Za-z0-9-]{1,64}$")
    """
    A webhook id: `whk_` then 1 to 64 letters, digits or `-`.
    """
    secret: Optional[str] = None
    """
    The new signing key, shown this once; absent when `secret_withheld`.
    """
    secret_withheld: Optional[bool] = None
    """
    True only in the answer to a repeat of a keyed rotation whose first answer was lost
    (its process died after the rotation committed): the store keeps no secret in clear,
    so the secret cannot be shown again. Rotate again if you did not choose it.
    """


class RunAgentView(BaseModel):
    hash: str
    id: str


class RunId(RootModel[str]):
    root: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """


class ScheduleId(RootModel[str]):
    root: str = Field(..., pattern="^sch_[A-Za-z0-9-]{1,64}$")
    """
    A schedule id: `sch_` then 1 to 64 letters, digits or `-`.
    """


class SendMessage(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
    )
    content: str = Field(..., pattern="\\S")
    """
    The message; it must have some text besides white space.
    """
    multitask: Optional[Literal["enqueue", "reject", "interrupt", "steer"]] = None


class ServerSentEvent(BaseModel):
    """
    One event as an event stream sends it: `id: <seq>`, `event: <kind>`, `data: <EventView>`.
    """

    data: str = Field(
        ...,
        json_schema_extra={
            "contentMediaType": "application/json",
            "contentSchema": {"$ref": "#/components/schemas/EventView"},
        },
    )
    """
    The whole event: an `EventView` as JSON.
    """
    event: str
    """
    The event's kind.
    """
    id: str
    """
    The event's `seq`: a client that reconnects sends the last one as `Last-Event-ID`.
    """


class ServerSentTreeEvent(BaseModel):
    """
    One event as a tree stream sends it: `id: <cursor>`, `event: <kind>`,
    `data: <TreeEventView>`.
    """

    data: str = Field(
        ...,
        json_schema_extra={
            "contentMediaType": "application/json",
            "contentSchema": {"$ref": "#/components/schemas/TreeEventView"},
        },
    )
    """
    The whole event: a `TreeEventView` as JSON.
    """
    event: str
    """
    The event's kind.
    """
    id: str
    """
    The stream's cursor after this event, `SESSION:SEQ` pairs joined by commas: a client
    that reconnects sends the last one as `Last-Event-ID`.
    """


class SessionId(RootModel[str]):
    root: str = Field(..., pattern="^ses_[A-Za-z0-9-]{1,64}$")
    """
    A session id: `ses_` then 1 to 64 letters, digits or `-`.
    """


class SessionOrder(RootModel[Literal["oldest", "newest", "activity"]]):
    root: Literal["oldest", "newest", "activity"]


class SessionStatusFilter(
    RootModel[Literal["waiting_human", "active", "failed", "idle", "archived"]]
):
    root: Literal["waiting_human", "active", "failed", "idle", "archived"]


class UpdateSchedule(BaseModel):
    """
    A change of a schedule: each field given replaces the one it has; the agent's configuration
    is frozen again from the catalog in force.
    """

    model_config = ConfigDict(
        extra="forbid",
    )
    agent: Optional[str] = None
    catch_up: Optional[Literal["skip", "one", "all"]] = None
    cron: Optional[str] = None
    """
    Replaces the cadence (and drops `every_ms`).
    """
    every_ms: Optional[int] = Field(None, ge=1000)
    """
    Replaces the cadence (and drops `cron` and `timezone`).
    """
    message: Optional[str] = Field(None, min_length=1)
    overlap: Optional[Literal["skip", "enqueue", "cancel_previous"]] = None
    paused: Optional[bool] = None
    session: Optional[str] = None
    """
    `new` or a session id.
    """
    timezone: Optional[str] = None


class UpdateSession(BaseModel):
    """
    `PATCH /v1/sessions/{id}`.
    """

    model_config = ConfigDict(
        extra="forbid",
    )
    title: str = Field(
        ...,
        max_length=200,
        min_length=1,
        pattern="^[^\\x00-\\x1f\\x7f-\\x9f]*[^\\s\\x00-\\x1f\\x7f-\\x9f][^\\x00-\\x1f\\x7f-\\x9f]*$",
    )
    """
    The session's new title: 1–200 characters once the white space around it is trimmed,
    not only white space, no control characters.
    """


class UsageView(BaseModel):
    cache_read_tokens: int = Field(..., ge=0)
    """
    The part of `input_tokens` read from the provider's prompt cache.
    """
    cache_write_tokens: int = Field(..., ge=0)
    """
    The part of `input_tokens` written to the provider's prompt cache.
    """
    cost_usd: Optional[float] = None
    """
    In US dollars, from the prices of the run's model profile; absent without prices.
    """
    input_tokens: int = Field(..., ge=0)
    model_calls: int = Field(..., ge=0)
    output_tokens: int = Field(..., ge=0)
    """
    Generated tokens, reasoning included.
    """
    reasoning_tokens: int = Field(..., ge=0)
    tool_calls: int = Field(..., ge=0)


class WebhookId(RootModel[str]):
    root: str = Field(..., pattern="^whk_[A-Za-z0-9-]{1,64}$")
    """
    A webhook id: `whk_` then 1 to 64 letters, digits or `-`.
    """


class ApprovalView(BaseModel):
    """
    A gated tool batch: no call of it runs until a human answers.
    """

    calls: list[ApprovalCallView]
    """
    Every call of the batch, in the model's order.
    """
    created_at: int
    decided_at: Optional[int] = None
    id: str = Field(..., pattern="^apr_[A-Za-z0-9-]{1,85}$")
    """
    A approval id: `apr_` then 1 to 85 letters, digits or `-`.
    """
    run_id: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """
    session_id: str = Field(..., pattern="^ses_[A-Za-z0-9-]{1,64}$")
    """
    A session id: `ses_` then 1 to 64 letters, digits or `-`.
    """
    status: Literal["pending", "decided", "aborted", "cancelled"]
    """
    `pending`, `decided`, `aborted`, or `cancelled` (its run ended unanswered).
    """


class CallDecisionBody(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
    )
    call_id: str
    decision: Literal["approve", "deny"]
    note: Optional[str] = None
    """
    Shown to the model with a denied call's result.
    """


class CancelView(BaseModel):
    run_id: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """
    status: Literal[
        "queued",
        "running",
        "waiting_human",
        "waiting_children",
        "waiting_timer",
        "paused",
        "cancelling",
        "completed",
        "failed",
        "cancelled",
    ]
    """
    `cancelled` when the run ended at once, `cancelling` while its step winds down, or the
    terminal status it already had.
    """


class CreateSchedule(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
    )
    agent: Optional[str] = None
    """
    The catalog agent its runs are of (`default`, or absent, for the server's run
    template); with an existing `session`, that session's agent or absent.
    """
    catch_up: Literal["skip", "one", "all"]
    """
    What becomes of the slots missed while no scheduler ran (more than 10 s late).
    """
    cron: Optional[str] = None
    """
    A cron expression: 5 fields (minute hour day-of-month month day-of-week) or 6 (seconds
    first). Exactly one of `cron` and `every_ms`.
    """
    every_ms: Optional[int] = Field(None, ge=1000)
    """
    An interval in milliseconds, at least 1000; slots fall on its multiples since the Unix
    epoch. Exactly one of `cron` and `every_ms`.
    """
    message: str = Field(..., min_length=1)
    """
    The message each run starts with.
    """
    overlap: Literal["skip", "enqueue", "cancel_previous"]
    """
    What a due slot does while the schedule's previous run has not finished.
    """
    paused: Optional[bool] = None
    """
    Created paused: it fires nothing until resumed (default false).
    """
    session: str
    """
    `new` (each run in a new session of its own) or the id of a session of yours, which
    every run goes to.
    """
    timezone: Optional[str] = None
    """
    The IANA time zone the cron expression is read in (default `UTC`); only with `cron`.
    """


class CreateWebhook(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
    )
    events: Optional[
        list[
            Literal[
                "run.created",
                "run.status",
                "step.committed",
                "activity",
                "assistant.delta",
                "assistant.message",
                "assistant.reasoning",
                "tool.call",
                "tool.result",
                "tool.outcome_unknown",
                "model.error",
                "reconciliation.required",
                "reconciliation.decided",
                "approval.required",
                "approval.decided",
                "run.resumed",
                "message.steered",
                "context.compacted",
                "subagent.started",
                "subagent.finished",
                "completion.blocked",
                "timer.set",
                "timer.woke",
                "inbox.reserved",
                "inbox.pending",
                "inbox.leased",
                "inbox.consumed",
                "inbox.released",
                "inbox.dead_lettered",
                "inbox.superseded",
                "inbox.requeued",
                "inbox.discarded",
                "signal.emitted",
                "session.closed",
                "run.finished",
            ]
        ]
    ] = Field(None, min_length=1)
    """
    The event kinds to send (for example `run.finished`); every kind when absent.
    """
    max_attempts: Optional[int] = Field(None, ge=1, le=50)
    """
    Attempts of one delivery before it is dead-lettered, 1–50 (default 10).
    """
    secret: Optional[str] = Field(
        None, max_length=256, min_length=16, pattern="^[!-~]{16,256}$"
    )
    """
    The key deliveries are signed with, 16–256 printable ASCII characters without spaces;
    one is made when absent.
    """
    url: str = Field(..., max_length=2048, pattern="^[hH][tT][tT][pP][sS]?://")
    """
    Where each event is POSTed: an absolute `http://` or `https://` URL without
    credentials, to a public address unless the server's `[webhooks] allow` permits
    another. It is stored as it will be requested (`http://2130706433` is
    `http://127.0.0.1/`).
    """


class DeliveryView(BaseModel):
    """
    One event's delivery to the webhook.
    """

    attempts: int = Field(..., ge=0)
    available_at: Optional[int] = None
    created_at: int
    delivered_at: Optional[int] = None
    event_kind: Literal[
        "run.created",
        "run.status",
        "step.committed",
        "activity",
        "assistant.delta",
        "assistant.message",
        "assistant.reasoning",
        "tool.call",
        "tool.result",
        "tool.outcome_unknown",
        "model.error",
        "reconciliation.required",
        "reconciliation.decided",
        "approval.required",
        "approval.decided",
        "run.resumed",
        "message.steered",
        "context.compacted",
        "subagent.started",
        "subagent.finished",
        "completion.blocked",
        "timer.set",
        "timer.woke",
        "inbox.reserved",
        "inbox.pending",
        "inbox.leased",
        "inbox.consumed",
        "inbox.released",
        "inbox.dead_lettered",
        "inbox.superseded",
        "inbox.requeued",
        "inbox.discarded",
        "signal.emitted",
        "session.closed",
        "run.finished",
    ]
    """
    the kind of a stored event.
    """
    id: int
    """
    Also the `Ratchet-Delivery` header of every attempt.
    """
    last_error: Optional[str] = None
    """
    Why the last attempt failed.
    """
    last_status: Optional[int] = Field(None, ge=0)
    """
    The HTTP status of the last answered attempt.
    """
    max_attempts: int = Field(..., ge=0)
    requeued_at: Optional[int] = None
    seq: int
    session_id: str = Field(..., pattern="^ses_[A-Za-z0-9-]{1,64}$")
    """
    A session id: `ses_` then 1 to 64 letters, digits or `-`.
    """
    status: Literal["pending", "delivering", "delivered", "dead_letter"]
    """
    `pending` (waiting for its attempt, behind the session's earlier events),
    `delivering`, `delivered` or `dead_letter`.
    """
    updated_at: int


class ErrorBody(BaseModel):
    error: ErrorDetail


class EventView(BaseModel):
    """
    The `data` of every server-sent event (its `id` is `seq`, its `event` is `kind`).
    """

    created_at: int
    kind: str
    payload: dict[str, Any]
    run_id: Optional[str] = Field(None, pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """
    seq: int
    """
    Per-session, gap-free and increasing: resume with `Last-Event-ID` or `?after=`.
    """
    session_id: str = Field(..., pattern="^ses_[A-Za-z0-9-]{1,64}$")
    """
    A session id: `ses_` then 1 to 64 letters, digits or `-`.
    """


class ForkEditRequest2(BaseModel):
    """
    The call returned this instead (a string as it is, any other JSON as its text); the
    fork's history ends with that call's batch, and the model is called next.
    """

    replace_tool_result: ReplaceToolResult
    """
    The call returned this instead (a string as it is, any other JSON as its text); the
    fork's history ends with that call's batch, and the model is called next.
    """


class ForkRequest(BaseModel):
    """
    `POST /v1/runs/{id}/fork`: a new session whose history is the run's as step `at_step`
    left it, and a run in it that continues from there.
    """

    model_config = ConfigDict(
        extra="forbid",
    )
    agent: Optional[str] = None
    """
    The catalog agent the fork runs as; without it, the run's own frozen configuration.
    """
    at_step: int = Field(..., ge=0)
    """
    The committed step of the run to fork at (steps are numbered from 1).
    """
    edit: Optional[Union[ForkEditRequest1, ForkEditRequest2]] = None


class ForkedView(BaseModel):
    """
    A fork, created: its new session and run.
    """

    forked_from: ForkedFromView
    run_id: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """
    session_id: str = Field(..., pattern="^ses_[A-Za-z0-9-]{1,64}$")
    """
    A session id: `ses_` then 1 to 64 letters, digits or `-`.
    """
    status: Literal[
        "queued",
        "running",
        "waiting_human",
        "waiting_children",
        "waiting_timer",
        "paused",
        "cancelling",
        "completed",
        "failed",
        "cancelled",
    ]
    """
    `running`, or `waiting_human` when a `never` call the source started has no known
    outcome: reconcile it on the fork (`POST /v1/runs/{run_id}/reconcile`).
    """


class InboxEventView(BaseModel):
    """
    One event of a session's inbox.
    """

    attempts: int = Field(..., ge=0)
    available_at: Optional[int] = None
    created_at: int
    delivery: str
    """
    `queue` or `steer`.
    """
    expires_at: Optional[int] = None
    group: Optional[str] = None
    id: int
    kind: str
    """
    `completion`, `group_completion` or `signal`.
    """
    lease_run_id: Optional[str] = Field(None, pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    The continuation run holding it, or that consumed it.
    """
    max_attempts: int = Field(..., ge=0)
    parent_run_id: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    The run whose `delegate` call started the work.
    """
    payload: Optional[Any] = None
    """
    What the work reported; absent while the event is a reservation.
    """
    reason: Optional[str] = None
    """
    Why it was dead-lettered, superseded or discarded, why its last attempt failed, or who
    requeued it.
    """
    requeued_at: Optional[int] = None
    source_run_id: Optional[str] = Field(None, pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """
    status: Literal[
        "reserved",
        "pending",
        "leased",
        "consumed",
        "dead_letter",
        "superseded",
        "discarded",
    ]
    """
    `reserved` (a place held for running work), `pending`, `leased` (a continuation turn
    holds it), `consumed`, `dead_letter`, `superseded` or `discarded` (a dead letter an
    operator dropped).
    """
    updated_at: int


class LiveActivityView(BaseModel):
    """
    The `data` of a live `activity` event: what a step in flight is doing right now
    (`loading_context`, `calling_model` with `model`, `executing_tools` with `tools`). It is
    never stored, so it has no `seq` and its server-sent event no `id`: it never moves a
    client's cursor, and no replay contains it.
    """

    created_at: int
    kind: str
    """
    Always `activity`.
    """
    live: bool
    """
    Always `true`: tells it from stored events, which have a `seq`.
    """
    payload: dict[str, Any]
    run_id: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """
    session_id: str = Field(..., pattern="^ses_[A-Za-z0-9-]{1,64}$")
    """
    A session id: `ses_` then 1 to 64 letters, digits or `-`.
    """


class MessageView(BaseModel):
    content: str
    created_at: int
    id: str = Field(..., pattern="^msg_[A-Za-z0-9-]+$")
    """
    A message id: `msg_` then letters, digits or `-`.
    """
    origin: str
    """
    `user`, `agent`, `continuation` or `steer`.
    """
    role: str
    """
    `user`, `assistant` or `tool`.
    """
    run_id: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """
    tool_call_id: Optional[str] = None
    tool_calls: list[dict[str, Any]]
    visibility: str
    """
    Always `visible`: hidden messages are never listed.
    """


class ModelCallView(BaseModel):
    messages: list[ModelMessageView]
    """
    The messages in the order sent, as the model saw them: the latest compaction summary
    first, long tool results cut to the run's limit, a call left without a result answered.
    """
    model: str
    """
    The model spec the run calls (`provider:model` or a profile name).
    """
    reply: Optional[ModelMessageView] = None
    system_prompt: str
    tools: list[OfferedToolView]
    """
    The tools offered; none when the step asked for a final answer (`conclude`).
    """


class PageApprovalView(BaseModel):
    """
    Every listing: a page of items and the cursor of the next page (null on the last).
    """

    items: list[ApprovalView]
    next_cursor: Optional[str] = None
    """
    An opaque cursor: pass it as `cursor` for the next page, unchanged. Null on the last
    page.
    """


class PageDeliveryView(BaseModel):
    """
    Every listing: a page of items and the cursor of the next page (null on the last).
    """

    items: list[DeliveryView]
    next_cursor: Optional[str] = None
    """
    An opaque cursor: pass it as `cursor` for the next page, unchanged. Null on the last
    page.
    """


class PageInboxEventView(BaseModel):
    """
    Every listing: a page of items and the cursor of the next page (null on the last).
    """

    items: list[InboxEventView]
    next_cursor: Optional[str] = None
    """
    An opaque cursor: pass it as `cursor` for the next page, unchanged. Null on the last
    page.
    """


class PageMessageView(BaseModel):
    """
    Every listing: a page of items and the cursor of the next page (null on the last).
    """

    items: list[MessageView]
    next_cursor: Optional[str] = None
    """
    An opaque cursor: pass it as `cursor` for the next page, unchanged. Null on the last
    page.
    """


class ReconcileView(BaseModel):
    run_id: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """
    status: Literal[
        "queued",
        "running",
        "waiting_human",
        "waiting_children",
        "waiting_timer",
        "paused",
        "cancelling",
        "completed",
        "failed",
        "cancelled",
    ]
    """
    `running` once every call in doubt is answered; `waiting_human` before. A call left in
    doubt by an ended run is recorded and the run keeps its terminal status.
    """


class ReloadView(BaseModel):
    """
    What is active after a reload.
    """

    agents: list[ActiveAgentView]
    """
    The catalog's agents in id order.
    """
    model: str
    """
    The model a run is frozen with when its session names no agent.
    """
    reloaded_at: int
    restart_required: list[str]
    """
    Settings that changed but take effect only after a restart, by configuration key
    (`listen`, `db`, `workers`, `lease_ms`, `heartbeat_ms`, `poll_ms`, `gates`, `mcp`,
    `webhooks`, `models`); empty when nothing needs one.
    """


class RunScheduleView(BaseModel):
    """
    Where a run fired by a schedule came from.
    """

    manual: bool
    """
    Fired by `POST /v1/schedules/{id}/trigger` rather than by the schedule's cadence.
    """
    schedule_id: str = Field(..., pattern="^sch_[A-Za-z0-9-]{1,64}$")
    """
    A schedule id: `sch_` then 1 to 64 letters, digits or `-`.
    """
    slot: int
    """
    When the slot was due (ms since the epoch); for a manual trigger, when it was asked for.
    """


class RunSummaryView(BaseModel):
    """
    A run as listed: its state without usage details.
    """

    created_at: int
    finished_at: Optional[int] = None
    forked_from: Optional[ForkedFromView] = None
    id: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """
    schedule_id: Optional[str] = Field(None, pattern="^sch_[A-Za-z0-9-]{1,64}$")
    """
    The schedule that fired the run, and the slot it fired for.
    """
    session_id: str = Field(..., pattern="^ses_[A-Za-z0-9-]{1,64}$")
    """
    A session id: `ses_` then 1 to 64 letters, digits or `-`.
    """
    slot: Optional[int] = None
    status: Literal[
        "queued",
        "running",
        "waiting_human",
        "waiting_children",
        "waiting_timer",
        "paused",
        "cancelling",
        "completed",
        "failed",
        "cancelled",
    ]
    """
    what a run is doing, or how it ended.
    """
    step_index: int = Field(..., ge=0)
    stop_reason: Optional[str] = None


class ScheduleRunView(BaseModel):
    """
    A decided slot of a schedule and its run, if it fired one.
    """

    decided_at: int
    manual: bool
    """
    Fired by a trigger rather than by the cadence.
    """
    outcome: Literal["fired", "skipped_overlap", "skipped_catch_up", "refused"]
    """
    What a decided slot became.
    """
    reason: Optional[str] = None
    """
    Why it was skipped or refused.
    """
    run_id: Optional[str] = Field(None, pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    The run it fired; null for a slot skipped or refused.
    """
    session_id: Optional[str] = Field(None, pattern="^ses_[A-Za-z0-9-]{1,64}$")
    """
    A session id: `ses_` then 1 to 64 letters, digits or `-`.
    """
    slot: int
    """
    When the slot was due (ms since the epoch); for a manual trigger, when it was asked for.
    """
    status: Optional[
        Literal[
            "queued",
            "running",
            "waiting_human",
            "waiting_children",
            "waiting_timer",
            "paused",
            "cancelling",
            "completed",
            "failed",
            "cancelled",
        ]
    ] = None
    through: int
    """
    The last slot of missed slots skipped together; `slot` otherwise.
    """


class ScheduleView(BaseModel):
    agent: Optional[str] = None
    catch_up: Literal["skip", "one", "all"]
    """
    What becomes of the slots missed while no scheduler ran (more than 10 s late).
    """
    created_at: int
    cron: Optional[str] = None
    every_ms: Optional[int] = Field(None, ge=0)
    id: str = Field(..., pattern="^sch_[A-Za-z0-9-]{1,64}$")
    """
    A schedule id: `sch_` then 1 to 64 letters, digits or `-`.
    """
    last_run_id: Optional[str] = Field(None, pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    The latest run it fired.
    """
    last_slot: Optional[int] = None
    message: str
    next_fire_at: Optional[int] = None
    overlap: Literal["skip", "enqueue", "cancel_previous"]
    """
    What a due slot does while the schedule's previous run has not finished.
    """
    paused: bool
    session: str
    """
    `new`, or the session every run goes to.
    """
    timezone: Optional[str] = None
    """
    The cron expression's time zone (null: UTC).
    """
    updated_at: int


class SessionView(BaseModel):
    active_run_id: Optional[str] = Field(None, pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    The run currently holding the session, if any.
    """
    agent: Optional[str] = None
    archived_at: Optional[int] = None
    created_at: int
    id: str = Field(..., pattern="^ses_[A-Za-z0-9-]{1,64}$")
    """
    A session id: `ses_` then 1 to 64 letters, digits or `-`.
    """
    last_activity_at: int
    """
    When the session's latest event was written (its creation, before any).
    """
    last_run_status: Optional[str] = None
    """
    How its latest run stands (`completed`, `failed`, …); null before any.
    """
    metadata: Optional[Any] = None
    parent_session_id: Optional[str] = Field(None, pattern="^ses_[A-Za-z0-9-]{1,64}$")
    """
    For a delegated run's session: the session of the run that delegated it. Such a
    session is read-only: messages go to its root session.
    """
    status: Literal[
        "queued",
        "running",
        "waiting_human",
        "waiting_children",
        "waiting_timer",
        "paused",
        "cancelling",
        "completed",
        "failed",
        "cancelled",
        "idle",
        "archived",
    ]
    """
    `archived`, the active run's status (`running`, `waiting_human`, …), or `idle`.
    """
    title: Optional[str] = None
    """
    Its first message's first line until someone renames it (`PATCH`); null before any.
    """


class StepView(BaseModel):
    duration_ms: int
    finished_at: int
    index: int = Field(..., ge=0)
    instruction: str
    """
    `call_llm`, `call_tools_batch` or `finish`.
    """
    started_at: int
    summary: dict[str, Any]


class TreeActivityView(LiveActivityView):
    """
    The `data` of a tree stream's live `activity` event, with where its run sits in the tree.
    """

    depth: int = Field(..., ge=0)
    parent_run_id: Optional[str] = Field(None, pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """


class TreeEventView(EventView):
    """
    The `data` of a tree stream's event: the event, with where its run sits in the tree.
    """

    depth: int = Field(..., ge=0)
    """
    Levels below the run a message started (0).
    """
    parent_run_id: Optional[str] = Field(None, pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    The run that started this event's run; `null` for the tree's root.
    """


class TreeNodeView(BaseModel):
    agent: Optional[str] = None
    """
    The catalog agent it runs, when it was started from one.
    """
    background: bool
    """
    Started with `mode: "background"`: it reports to the session's inbox.
    """
    created_at: int
    depth: int = Field(..., ge=0)
    """
    Levels below the run a message started, at the top of its whole tree (0 for that run),
    also when the tree is asked about a run further down.
    """
    finished_at: Optional[int] = None
    parent_run_id: Optional[str] = Field(None, pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    The run whose delegation started it; absent for a run started by a message.
    """
    run_id: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """
    session_id: str = Field(..., pattern="^ses_[A-Za-z0-9-]{1,64}$")
    """
    Each delegated run has a session of its own.
    """
    status: Literal[
        "queued",
        "running",
        "waiting_human",
        "waiting_children",
        "waiting_timer",
        "paused",
        "cancelling",
        "completed",
        "failed",
        "cancelled",
    ]
    """
    what a run is doing, or how it ended.
    """
    steps: int = Field(..., ge=0)
    """
    Its committed steps.
    """
    stop_reason: Optional[str] = None
    usage: UsageView
    """
    What this run itself spent (not its children); `cost_usd` is absent until a priced
    model call has cost something.
    """


class WaitView(BaseModel):
    """
    A run's wait on a timer: when it began and when it ends, unless input ended it sooner.
    """

    call_id: str
    """
    The `wait` call the run parked on.
    """
    due_at: int
    """
    When the wait ends (ms since the epoch), frozen when the run parked.
    """
    since: int
    """
    When the run parked (ms since the epoch).
    """
    woken_by_input: Optional[int] = None


class WebhookView(BaseModel):
    created_at: int
    events: Optional[
        list[
            Literal[
                "run.created",
                "run.status",
                "step.committed",
                "activity",
                "assistant.delta",
                "assistant.message",
                "assistant.reasoning",
                "tool.call",
                "tool.result",
                "tool.outcome_unknown",
                "model.error",
                "reconciliation.required",
                "reconciliation.decided",
                "approval.required",
                "approval.decided",
                "run.resumed",
                "message.steered",
                "context.compacted",
                "subagent.started",
                "subagent.finished",
                "completion.blocked",
                "timer.set",
                "timer.woke",
                "inbox.reserved",
                "inbox.pending",
                "inbox.leased",
                "inbox.consumed",
                "inbox.released",
                "inbox.dead_lettered",
                "inbox.superseded",
                "inbox.requeued",
                "inbox.discarded",
                "signal.emitted",
                "session.closed",
                "run.finished",
            ]
        ]
    ] = None
    """
    The event kinds it is sent; null for every kind.
    """
    id: str = Field(..., pattern="^whk_[A-Za-z0-9-]{1,64}$")
    """
    A webhook id: `whk_` then 1 to 64 letters, digits or `-`.
    """
    max_attempts: int = Field(..., ge=0)
    secret: Optional[str] = None
    """
    The signing key: in the answer to the creation only.
    """
    secret_withheld: Optional[bool] = None
    """
    True only in the answer to a repeat of a keyed creation whose first answer was lost
    (its process died after the webhook was created): the store keeps no secret in clear,
    so the secret cannot be shown again. Rotate it if you did not choose it.
    """
    url: str


class ApprovalRequestBody1(BaseModel):
    """
    Either `decisions` (every call that needs approval, once) or `"abort": true`, which ends the run as cancelled by a human.
    """

    model_config = ConfigDict(
        extra="forbid",
    )
    abort: Optional[Literal[False]] = None
    decisions: list[CallDecisionBody]
    """
    One decision per call that needs approval; a call left out is approved.
    """


class ApprovalRequestBody(RootModel[Union[ApprovalRequestBody1, ApprovalRequestBody2]]):
    root: Union[ApprovalRequestBody1, ApprovalRequestBody2]
    """
    Either `decisions` (every call that needs approval, once) or `"abort": true`, which ends the run as cancelled by a human.
    """


class PageRunSummaryView(BaseModel):
    """
    Every listing: a page of items and the cursor of the next page (null on the last).
    """

    items: list[RunSummaryView]
    next_cursor: Optional[str] = None
    """
    An opaque cursor: pass it as `cursor` for the next page, unchanged. Null on the last
    page.
    """


class PageScheduleRunView(BaseModel):
    """
    Every listing: a page of items and the cursor of the next page (null on the last).
    """

    items: list[ScheduleRunView]
    next_cursor: Optional[str] = None
    """
    An opaque cursor: pass it as `cursor` for the next page, unchanged. Null on the last
    page.
    """


class PageScheduleView(BaseModel):
    """
    Every listing: a page of items and the cursor of the next page (null on the last).
    """

    items: list[ScheduleView]
    next_cursor: Optional[str] = None
    """
    An opaque cursor: pass it as `cursor` for the next page, unchanged. Null on the last
    page.
    """


class PageSessionView(BaseModel):
    """
    Every listing: a page of items and the cursor of the next page (null on the last).
    """

    items: list[SessionView]
    next_cursor: Optional[str] = None
    """
    An opaque cursor: pass it as `cursor` for the next page, unchanged. Null on the last
    page.
    """


class PageStepView(BaseModel):
    """
    Every listing: a page of items and the cursor of the next page (null on the last).
    """

    items: list[StepView]
    next_cursor: Optional[str] = None
    """
    An opaque cursor: pass it as `cursor` for the next page, unchanged. Null on the last
    page.
    """


class PageWebhookView(BaseModel):
    """
    Every listing: a page of items and the cursor of the next page (null on the last).
    """

    items: list[WebhookView]
    next_cursor: Optional[str] = None
    """
    An opaque cursor: pass it as `cursor` for the next page, unchanged. Null on the last
    page.
    """


class RunTreeView(BaseModel):
    """
    A run and every run below it: the children its delegations started, theirs, and so on.
    """

    nodes: list[TreeNodeView]
    """
    Parents before their children, each level in creation order.
    """
    run_id: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    The run asked about: the first node.
    """


class RunView(BaseModel):
    agent: Optional[RunAgentView] = None
    budgets: list[BudgetView]
    """
    Each budget the run has (`steps` always; the others when set), with what it used of
    it, extensions given by `continue` included: which one ran out, and by how much.
    """
    completion_blockers: list[dict[str, Any]]
    """
    What blocked the last refused completion (`{"kind", …}` each); empty once met.
    """
    completion_refusals: int = Field(..., ge=0)
    """
    Completions refused because a criterion of the run's agent was unmet.
    """
    created_at: int
    final_answer: Optional[str] = None
    """
    The run's answer, once it has completed.
    """
    finished_at: Optional[int] = None
    forked_from: Optional[ForkedFromView] = None
    id: str = Field(..., pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    A run id: `run_` then 1 to 64 letters, digits or `-`.
    """
    in_doubt: list[dict[str, Any]]
    """
    `never` calls cut off when the run ended (its deadline, a cancel): nobody knows whether
    they took effect. `POST /v1/runs/{id}/reconcile` records what happened to each
    (`succeeded`, `failed` or `skip`; the run stays ended).
    """
    parent_run_id: Optional[str] = Field(None, pattern="^run_[A-Za-z0-9-]{1,64}$")
    """
    The run that delegated this one, for a child run.
    """
    pause_requested: bool
    """
    A pause was asked for while a step was in flight: the run pauses when that step ends.
    """
    pending_human: Optional[dict[str, Any]] = None
    """
    What the run waits on a human for, if anything.
    """
    schedule: Optional[RunScheduleView] = None
    session_id: str = Field(..., pattern="^ses_[A-Za-z0-9-]{1,64}$")
    """
    A session id: `ses_` then 1 to 64 letters, digits or `-`.
    """
    started_at: Optional[int] = None
    status: Literal[
        "queued",
        "running",
        "waiting_human",
        "waiting_children",
        "waiting_timer",
        "paused",
        "cancelling",
        "completed",
        "failed",
        "cancelled",
    ]
    """
    `queued`, `running`, `waiting_human`, `waiting_children`, `waiting_timer`, `paused`,
    `cancelling`, `completed`, `failed` or `cancelled`.
    """
    step_index: int = Field(..., ge=0)
    """
    The last committed step (steps are numbered from 1).
    """
    stop_reason: Optional[str] = None
    usage: UsageView
    wait: Optional[WaitView] = None


class StepDetailView(StepView):
    """
    One committed step, opened up: what it sent to the model and what came back.
    """

    model_call: Optional[ModelCallView] = None
    written: list[ModelMessageView]
    """
    What the step's commit wrote to the session's history: a model call's reply, a batch's
    results, a compaction's summary, the reports it handed on. Hidden ones included.
    """
