"""Every API operation the clients offer, as data: which request to send and what model its
answer is read into. `Client` and `AsyncClient` only send these, so the two cannot drift
apart."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Type, Union
from urllib.parse import quote

from pydantic import BaseModel

from . import models
from .errors import api_error

#: What a `decide_approval` decision may be given as: the generated model or a plain mapping
#: with the same fields (`call_id`, `decision`, optional `note`).
Decision = Union[models.CallDecisionBody, Mapping[str, Any]]


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    #: The JSON body, or `None` to send none.
    body: Optional[Dict[str, Any]] = None
    params: Optional[Dict[str, Any]] = None
    #: The model the answer is read into; `None` for an answer without content.
    answer: Optional[Type[BaseModel]] = None
    #: Sent as `Idempotency-Key`; an operation with one is sent again, with the same key,
    #: when it may or may not have arrived (see `Retrying`).
    idempotency_key: Optional[str] = None

    def headers(self) -> Optional[Dict[str, str]]:
        if self.idempotency_key is None:
            return None
        return {IDEMPOTENCY_KEY: self.idempotency_key}


def _segment(value: str) -> str:
    """An id as one path segment: whatever it holds, it cannot reach another route."""
    return quote(str(value), safe="")


def _present(**fields: Any) -> Dict[str, Any]:
    """The fields that were given: an absent optional field is left out, not sent as null."""
    return {name: value for name, value in fields.items() if value is not None}


def _page(cursor: Optional[str], limit: Optional[int], **filters: Any) -> Dict[str, Any]:
    return _present(cursor=cursor, limit=limit, **filters)


def fresh_key() -> str:
    """A new idempotency key: a random UUID (version 4)."""
    return str(uuid.uuid4())


def create_session(
    agent: Optional[str], metadata: Optional[Mapping[str, Any]], idempotency_key: Optional[str]
) -> Operation:
    body = _present(agent=agent, metadata=dict(metadata) if metadata is not None else None)
    return Operation(
        "POST",
        "/v1/sessions",
        body=body,
        answer=models.SessionView,
        idempotency_key=idempotency_key if idempotency_key is not None else fresh_key(),
    )


def get_session(session_id: str) -> Operation:
    return Operation("GET", f"/v1/sessions/{_segment(session_id)}", answer=models.SessionView)


def list_sessions(cursor: Optional[str], limit: Optional[int], filters: Dict[str, Any]) -> Operation:
    return Operation(
        "GET", "/v1/sessions", params=_page(cursor, limit, **filters), answer=models.PageSessionView
    )


def archive_session(session_id: str) -> Operation:
    path = f"/v1/sessions/{_segment(session_id)}/archive"
    return Operation("POST", path, answer=models.SessionView)


def delete_session(session_id: str) -> Operation:
    return Operation("DELETE", f"/v1/sessions/{_segment(session_id)}")


def send_message(
    session_id: str, content: str, multitask: str, idempotency_key: Optional[str]
) -> Operation:
    return Operation(
        "POST",
        f"/v1/sessions/{_segment(session_id)}/messages",
        body={"content": content, "multitask": multitask},
        answer=models.MessageAccepted,
        idempotency_key=idempotency_key if idempotency_key is not None else fresh_key(),
    )


def list_messages(session_id: str, cursor: Optional[str], limit: Optional[int]) -> Operation:
    return Operation(
        "GET",
        f"/v1/sessions/{_segment(session_id)}/messages",
        params=_page(cursor, limit),
        answer=models.PageMessageView,
    )


def get_run(run_id: str) -> Operation:
    return Operation("GET", f"/v1/runs/{_segment(run_id)}", answer=models.RunView)


def list_runs(session_id: str, cursor: Optional[str], limit: Optional[int]) -> Operation:
    return Operation(
        "GET",
        f"/v1/sessions/{_segment(session_id)}/runs",
        params=_page(cursor, limit),
        answer=models.PageRunSummaryView,
    )


def cancel(run_id: str) -> Operation:
    return Operation("POST", f"/v1/runs/{_segment(run_id)}/cancel", answer=models.CancelView)


def pause(run_id: str) -> Operation:
    return Operation("POST", f"/v1/runs/{_segment(run_id)}/pause", answer=models.PauseView)


def resume(run_id: str) -> Operation:
    return Operation("POST", f"/v1/runs/{_segment(run_id)}/resume", answer=models.ResumedView)


def retry(run_id: str) -> Operation:
    return Operation("POST", f"/v1/runs/{_segment(run_id)}/retry", answer=models.ResumedView)


def continue_run(run_id: str, extra: Dict[str, Optional[int]]) -> Operation:
    return Operation(
        "POST",
        f"/v1/runs/{_segment(run_id)}/continue",
        body=_present(**extra),
        answer=models.ResumedView,
    )


def reconcile(run_id: str, call_id: str, outcome: str, result: Optional[str]) -> Operation:
    return Operation(
        "POST",
        f"/v1/runs/{_segment(run_id)}/reconcile",
        body=_present(call_id=call_id, outcome=outcome, result=result),
        answer=models.ReconcileView,
    )


def list_approvals(status: Optional[str], cursor: Optional[str], limit: Optional[int]) -> Operation:
    return Operation(
        "GET",
        "/v1/approvals",
        params=_page(cursor, limit, status=status),
        answer=models.PageApprovalView,
    )


def get_approval(approval_id: str) -> Operation:
    path = f"/v1/approvals/{_segment(approval_id)}"
    return Operation("GET", path, answer=models.ApprovalView)


def decide_approval(
    approval_id: str, decisions: Optional[Sequence[Decision]], abort: bool
) -> Operation:
    if abort == (decisions is not None):
        raise ValueError("give either decisions or abort=True, not both and not neither")
    body: Dict[str, Any]
    if abort:
        body = {"abort": True}
    else:
        body = {"decisions": [_decision(d) for d in decisions or ()]}
    path = f"/v1/approvals/{_segment(approval_id)}"
    return Operation("POST", path, body=body, answer=models.ApprovalView)


def _decision(decision: Decision) -> Dict[str, Any]:
    if isinstance(decision, BaseModel):
        return decision.model_dump(mode="json", exclude_none=True)
    return _present(**decision)


def create_webhook(
    url: str,
    events: Optional[Sequence[str]],
    secret: Optional[str],
    max_attempts: Optional[int],
) -> Operation:
    body = _present(
        url=url,
        events=list(events) if events is not None else None,
        secret=secret,
        max_attempts=max_attempts,
    )
    return Operation("POST", "/v1/webhooks", body=body, answer=models.WebhookView)


def list_webhooks() -> Operation:
    return Operation("GET", "/v1/webhooks", answer=models.PageWebhookView)


def get_webhook(webhook_id: str) -> Operation:
    return Operation("GET", f"/v1/webhooks/{_segment(webhook_id)}", answer=models.WebhookView)


def delete_webhook(webhook_id: str) -> Operation:
    return Operation("DELETE", f"/v1/webhooks/{_segment(webhook_id)}")


def rotate_webhook_secret(webhook_id: str, secret: Optional[str]) -> Operation:
    return Operation(
        "POST",
        f"/v1/webhooks/{_segment(webhook_id)}/rotate-secret",
        body=None if secret is None else {"secret": secret},
        answer=models.RotatedSecret,
    )


def list_deliveries(
    webhook_id: str, status: Optional[str], cursor: Optional[str], limit: Optional[int]
) -> Operation:
    return Operation(
        "GET",
        f"/v1/webhooks/{_segment(webhook_id)}/deliveries",
        params=_page(cursor, limit, status=status),
        answer=models.PageDeliveryView,
    )


def requeue_delivery(webhook_id: str, delivery_id: int) -> Operation:
    path = f"/v1/webhooks/{_segment(webhook_id)}/deliveries/{int(delivery_id)}/requeue"
    return Operation("POST", path, answer=models.DeliveryView)


def requeue_dead_deliveries(webhook_id: str) -> Operation:
    path = f"/v1/webhooks/{_segment(webhook_id)}/deliveries/requeue"
    return Operation("POST", path, answer=models.RequeuedView)


def session_events_path(session_id: str) -> str:
    return f"/v1/sessions/{_segment(session_id)}/events"


def run_events_path(run_id: str) -> str:
    return f"/v1/runs/{_segment(run_id)}/events"


def read_answer(operation: Operation, status: int, text: str) -> Any:
    """The answer's model, or the typed error of an error status."""
    if status >= 400:
        raise api_error(status, text)
    if operation.answer is None:
        return None
    return operation.answer.model_validate_json(text)


def read_raw_answer(status: int, text: str) -> Any:
    """The decoded JSON of a successful answer (`None` when it has no content)."""
    if status >= 400:
        raise api_error(status, text)
    return json.loads(text) if text else None


#: The request header that names a request, so that sending it again does it once.
IDEMPOTENCY_KEY = "Idempotency-Key"
#: The error code of a keyed request sent again while the first is still carried out.
REQUEST_IN_PROGRESS = "request_in_progress"


@dataclass(frozen=True)
class RetryPolicy:
    """How a keyed operation is sent again: at most `max_attempts` sends in all, waiting
    `backoff` seconds before the second, twice as long before each next, and none begun more
    than `max_time` seconds after the first failed (the server's `Retry-After` waits
    included), so that a first send that timed out is still sent again."""

    max_attempts: int
    backoff: float
    max_time: float


class Retrying:
    """The attempts of one keyed operation. It is sent again, with the same key, only when it
    may or may not have arrived: no answer at all (a refused or broken connection, a timeout),
    or `409 request_in_progress` (the first is still being carried out: wait its
    `Retry-After`). Every other answer is final."""

    def __init__(self, policy: RetryPolicy) -> None:
        self._policy = policy
        self._first_failure: Optional[float] = None
        self._attempts = 1
        self._backoff = policy.backoff

    def after_no_answer(self) -> Optional[float]:
        """Seconds to wait before the next attempt, or `None` to give up."""
        return self._next(self._backoff)

    def after_answer(self, status: int, retry_after: Optional[str], text: str) -> Optional[float]:
        """Seconds to wait before the next attempt after this answer, or `None` when the
        answer is final (or the attempts are spent)."""
        if status != 409 or api_error(status, text).code != REQUEST_IN_PROGRESS:
            return None
        return self._next(_seconds(retry_after, self._backoff))

    def _next(self, delay: float) -> Optional[float]:
        now = time.monotonic()
        if self._first_failure is None:
            self._first_failure = now
        remaining = self._policy.max_time - (now - self._first_failure)
        if self._attempts >= self._policy.max_attempts or remaining <= 0:
            return None
        self._attempts += 1
        self._backoff *= 2
        return min(delay, remaining)


def _seconds(retry_after: Optional[str], default: float) -> float:
    """A `Retry-After` in seconds (the server sends whole seconds), or `default`."""
    try:
        seconds = float(retry_after) if retry_after is not None else default
    except ValueError:
        return default
    return seconds if seconds >= 0 else default


#: Statuses `wait_run` returns at: the run has ended, or it will not move until someone acts
#: (an approval or reconciliation to answer, a pause to resume).
SETTLED_RUN_STATUSES = frozenset(
    {"completed", "failed", "cancelled", "waiting_human", "paused"}
)
#: `wait_run` polls the run this often at first, then less often, up to the cap.
FIRST_POLL_INTERVAL = 0.05
MAX_POLL_INTERVAL = 1.0
