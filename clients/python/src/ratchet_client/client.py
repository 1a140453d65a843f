"""The synchronous client."""

from __future__ import annotations

import time
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence

import httpx

from . import _operations as op
from . import models
from ._sse import Event, Resumption, SseParser, is_retryable
from .errors import TransportError, WaitTimeout, api_error

#: Seconds a request may take, unless the client is given another timeout.
DEFAULT_TIMEOUT = 30.0
#: Seconds an event stream may stay disconnected before its iterator gives up.
DEFAULT_MAX_RECONNECT_TIME = 60.0
#: Seconds without a byte before an event stream counts as dropped: the server sends a
#: keep-alive comment every 15 s, so a silent connection is a dead one.
STREAM_READ_TIMEOUT = 45.0
#: How `create_session` and `send_message` are sent again, with the same `Idempotency-Key`,
#: when they may or may not have arrived: at most this many sends in all...
DEFAULT_MAX_ATTEMPTS = 4
#: ...waiting this many seconds before the second, twice as long before each next...
DEFAULT_RETRY_BACKOFF = 0.25
#: ...and none begun more than this many seconds after the first failure (`Retry-After` waits
#: included).
DEFAULT_MAX_RETRY_TIME = 10.0


def auth_headers(token: Optional[str]) -> Dict[str, str]:
    return {} if token is None else {"Authorization": f"Bearer {token}"}


def stream_timeout(timeout: float) -> httpx.Timeout:
    return httpx.Timeout(timeout, read=STREAM_READ_TIMEOUT)


class Client:
    """A client of one Ratchet server's HTTP API.

    `token` is sent as `Authorization: Bearer TOKEN` (a server without `[[tokens]]` needs
    none); `timeout` bounds each request in seconds; `max_reconnect_time` is how long, by
    default, an event iterator keeps trying to reconnect before it raises
    `StreamDisconnected`. Use it as a context manager, or call `close()`.

    `create_session` and `send_message` send an `Idempotency-Key` (the caller's
    `idempotency_key`, or a fresh random UUID per call) and are sent again with the same key
    when they may or may not have arrived: no answer (a refused or broken connection, a
    timeout) or `409 request_in_progress` (after its `Retry-After`). At most `max_attempts`
    sends, waiting `retry_backoff` seconds before the second and twice as long before each
    next, none begun more than `max_retry_time` seconds after the first failure; then the
    last failure is raised. `max_attempts=1` sends once.
    """

    def __init__(
        self,
        base_url: str,
        token: Optional[str] = None,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        max_reconnect_time: float = DEFAULT_MAX_RECONNECT_TIME,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        retry_backoff: float = DEFAULT_RETRY_BACKOFF,
        max_retry_time: float = DEFAULT_MAX_RETRY_TIME,
    ) -> None:
        self._timeout = timeout
        self._max_reconnect_time = max_reconnect_time
        self._retry = op.RetryPolicy(max_attempts, retry_backoff, max_retry_time)
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), headers=auth_headers(token), timeout=timeout
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _send(self, operation: op.Operation) -> Any:
        retrying = op.Retrying(self._retry) if operation.idempotency_key is not None else None
        while True:
            try:
                response = self._http.request(
                    operation.method,
                    operation.path,
                    params=operation.params,
                    json=operation.body,
                    headers=operation.headers(),
                )
            except httpx.TransportError as error:
                delay = retrying.after_no_answer() if retrying is not None else None
                if delay is None:
                    raise TransportError(f"{operation.method} {operation.path}: {error}") from error
            else:
                delay = None
                if retrying is not None:
                    retry_after = response.headers.get("Retry-After")
                    delay = retrying.after_answer(response.status_code, retry_after, response.text)
                if delay is None:
                    return op.read_answer(operation, response.status_code, response.text)
            time.sleep(delay)

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Optional[Mapping[str, Any]] = None,
        json: Any = None,
        content: Optional[bytes] = None,
        headers: Optional[Mapping[str, str]] = None,
    ) -> Any:
        """Any request to the API, for endpoints without a method of their own; answers the
        decoded JSON body (`None` without one) and raises the typed errors.

        It is sent once. Any `POST` under `/v1` takes an idempotency key as a header,
        `headers={"Idempotency-Key": key}`: sent again with the same key (after a
        `TransportError`, say), it is carried out once and answered as the first time."""
        try:
            response = self._http.request(
                method, path, params=params, json=json, content=content, headers=headers
            )
        except httpx.TransportError as error:
            raise TransportError(f"{method} {path}: {error}") from error
        return op.read_raw_answer(response.status_code, response.text)

    # Sessions and messages.

    def create_session(
        self,
        agent: Optional[str] = None,
        metadata: Optional[Mapping[str, Any]] = None,
        *,
        idempotency_key: Optional[str] = None,
    ) -> models.SessionView:
        """Creates a session. It is sent with `idempotency_key` (a fresh UUID without one) and
        sent again with it when it may not have arrived; the same key again, later, answers
        the same session and creates none."""
        return self._send(op.create_session(agent, metadata, idempotency_key))

    def get_session(self, session_id: str) -> models.SessionView:
        return self._send(op.get_session(session_id))

    def list_sessions(
        self, cursor: Optional[str] = None, limit: Optional[int] = None, **filters: Any
    ) -> models.PageSessionView:
        """One page of sessions; `filters` are the API's (`order`, `status`, `agent`,
        `created_from`, `created_before`, `q`)."""
        return self._send(op.list_sessions(cursor, limit, filters))

    def archive_session(self, session_id: str) -> models.SessionView:
        return self._send(op.archive_session(session_id))

    def delete_session(self, session_id: str) -> None:
        self._send(op.delete_session(session_id))

    def send_message(
        self,
        session_id: str,
        content: str,
        multitask: str = "enqueue",
        *,
        idempotency_key: Optional[str] = None,
    ) -> models.MessageAccepted:
        """Sends a message; `multitask` says what happens when a run is active: `enqueue`,
        `reject`, `interrupt` or `steer`.

        It is sent with `idempotency_key` (a fresh UUID without one) and sent again with it
        when it may not have arrived, so a message is taken once. The same key again, later,
        gets the first answer back and starts nothing; the same key with another message
        raises `UnprocessableEntity`."""
        return self._send(op.send_message(session_id, content, multitask, idempotency_key))

    def list_messages(
        self, session_id: str, cursor: Optional[str] = None, limit: Optional[int] = None
    ) -> models.PageMessageView:
        return self._send(op.list_messages(session_id, cursor, limit))

    # Runs.

    def get_run(self, run_id: str) -> models.RunView:
        return self._send(op.get_run(run_id))

    def list_runs(
        self, session_id: str, cursor: Optional[str] = None, limit: Optional[int] = None
    ) -> models.PageRunSummaryView:
        return self._send(op.list_runs(session_id, cursor, limit))

    def wait_run(self, run_id: str, timeout: float = 300.0) -> models.RunView:
        """Waits until the run has ended (`completed`, `failed`, `cancelled`) or waits for a
        person (`waiting_human`: an approval or reconciliation to answer; `paused`), and
        returns it as it then stands. Raises `WaitTimeout` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        interval = op.FIRST_POLL_INTERVAL
        while True:
            run = self.get_run(run_id)
            if run.status in op.SETTLED_RUN_STATUSES:
                return run
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"run {run_id} is still {run.status} after {timeout:g} s")
            time.sleep(min(interval, remaining))
            interval = min(interval * 2, op.MAX_POLL_INTERVAL)

    def cancel(self, run_id: str) -> models.CancelView:
        return self._send(op.cancel(run_id))

    def pause(self, run_id: str) -> models.PauseView:
        return self._send(op.pause(run_id))

    def resume(self, run_id: str) -> models.ResumedView:
        return self._send(op.resume(run_id))

    def retry(self, run_id: str) -> models.ResumedView:
        return self._send(op.retry(run_id))

    def continue_run(
        self,
        run_id: str,
        *,
        extra_steps: Optional[int] = None,
        extra_model_calls: Optional[int] = None,
        extra_tool_calls: Optional[int] = None,
        extra_tokens: Optional[int] = None,
        extra_duration_ms: Optional[int] = None,
    ) -> models.ResumedView:
        extra = dict(
            extra_steps=extra_steps,
            extra_model_calls=extra_model_calls,
            extra_tool_calls=extra_tool_calls,
            extra_tokens=extra_tokens,
            extra_duration_ms=extra_duration_ms,
        )
        return self._send(op.continue_run(run_id, extra))

    def reconcile(
        self, run_id: str, call_id: str, outcome: str, result: Optional[str] = None
    ) -> models.ReconcileView:
        """Answers for a call whose outcome is unknown: `succeeded`, `failed`, `retry` or
        `skip`."""
        return self._send(op.reconcile(run_id, call_id, outcome, result))

    # Approvals.

    def list_approvals(
        self,
        status: Optional[str] = None,
        cursor: Optional[str] = None,
        limit: Optional[int] = None,
    ) -> models.PageApprovalView:
        return self._send(op.list_approvals(status, cursor, limit))

    def get_approval(self, approval_id: str) -> models.ApprovalView:
        return self._send(op.get_approval(approval_id))

    def decide_approval(
        self,
        approval_id: str,
        decisions: Optional[Sequence[op.Decision]] = None,
        *,
        abort: bool = False,
    ) -> models.ApprovalView:
        """Answers an approval: `decisions`, one per call that needs approval
        (`{"call_id", "decision": "approve"|"deny", "note"?}`), or `abort=True` to end the run
        as cancelled."""
        return self._send(op.decide_approval(approval_id, decisions, abort))

    # Webhooks.

    def create_webhook(
        self,
        url: str,
        events: Optional[Sequence[str]] = None,
        secret: Optional[str] = None,
        max_attempts: Optional[int] = None,
    ) -> models.WebhookView:
        """Creates a webhook; the answer carries its signing secret, this once."""
        return self._send(op.create_webhook(url, events, secret, max_attempts))

    def list_webhooks(self) -> models.PageWebhookView:
        return self._send(op.list_webhooks())

    def get_webhook(self, webhook_id: str) -> models.WebhookView:
        return self._send(op.get_webhook(webhook_id))

    def delete_webhook(self, webhook_id: str) -> None:
        self._send(op.delete_webhook(webhook_id))

    def rotate_webhook_secret(
        self, webhook_id: str, secret: Optional[str] = None
    ) -> models.RotatedSecret:
        return self._send(op.rotate_webhook_secret(webhook_id, secret))

    def list_deliveries(
        self,
        webhook_id: str,
        status: Optional[str] = None,
        cursor: Optional[str] = None,
        limit: Optional[int] = None,
    ) -> models.PageDeliveryView:
        return self._send(op.list_deliveries(webhook_id, status, cursor, limit))

    def requeue_delivery(self, webhook_id: str, delivery_id: int) -> models.DeliveryView:
        return self._send(op.requeue_delivery(webhook_id, delivery_id))

    def requeue_dead_deliveries(self, webhook_id: str) -> models.RequeuedView:
        return self._send(op.requeue_dead_deliveries(webhook_id))

    # Events.

    def events(
        self,
        session_id: str,
        after: Optional[int] = None,
        follow: bool = True,
        *,
        max_reconnect_time: Optional[float] = None,
    ) -> Iterator[Event]:
        """The session's events after `seq` `after` (from its first without), then, with
        `follow`, live ones as they happen; see `run_events`."""
        path = op.session_events_path(session_id)
        return self._follow(path, after, follow, max_reconnect_time)

    def run_events(
        self,
        run_id: str,
        after: Optional[int] = None,
        follow: bool = True,
        *,
        max_reconnect_time: Optional[float] = None,
    ) -> Iterator[Event]:
        """The run's events: each stored one (`EventView`) exactly once, in `seq` order, and
        the live activity of its steps (`LiveActivityView`, no `seq`) while following.

        A dropped connection or a server restart is resumed with `Last-Event-ID`, waiting
        longer after each failed attempt, until `max_reconnect_time` seconds pass without a
        connection (`StreamDisconnected`). Without `follow` the iterator ends after the stored
        events; with it, it never ends by itself: stop iterating (or `close()` it) when done.
        """
        path = op.run_events_path(run_id)
        return self._follow(path, after, follow, max_reconnect_time)

    def _follow(
        self, path: str, after: Optional[int], follow: bool, max_reconnect_time: Optional[float]
    ) -> Iterator[Event]:
        if max_reconnect_time is None:
            max_reconnect_time = self._max_reconnect_time
        resumption = Resumption(after, max_reconnect_time)
        params = {"follow": follow}
        while True:
            cause: Optional[BaseException] = None
            try:
                with self._http.stream(
                    "GET",
                    path,
                    params=params,
                    headers=resumption.headers(),
                    timeout=stream_timeout(self._timeout),
                ) as response:
                    if response.status_code != 200:
                        response.read()
                        error = api_error(response.status_code, response.text)
                        if not is_retryable(error):
                            raise error
                        cause = error
                    else:
                        resumption.connected()
                        parser = SseParser()
                        for line in response.iter_lines():
                            sse = parser.feed(line)
                            event = resumption.accept(sse) if sse is not None else None
                            if event is not None:
                                yield event
                        if not follow:
                            return
            except httpx.TransportError as error:
                cause = error
            time.sleep(resumption.reconnect_delay(cause))
