"""The asynchronous client."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Mapping, Optional, Sequence

import anyio
import httpx

from . import _operations as op
from . import models
from ._sse import Event, Resumption, SseParser, is_retryable
from .client import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_RECONNECT_TIME,
    DEFAULT_MAX_RETRY_TIME,
    DEFAULT_RETRY_BACKOFF,
    DEFAULT_TIMEOUT,
    auth_headers,
    stream_timeout,
)
from .errors import TransportError, WaitTimeout, api_error


class AsyncClient:
    """The asynchronous client of one Ratchet server's HTTP API: the methods of `Client`,
    awaited.

    `token` is sent as `Authorization: Bearer TOKEN` (a server without `[[tokens]]` needs
    none); `timeout` bounds each request in seconds; `max_reconnect_time` is how long, by
    default, an event iterator keeps trying to reconnect before it raises
    `StreamDisconnected`. Use it as an async context manager, or await `close()`.

    `create_session` and `send_message` send an `Idempotency-Key` and are sent again with it
    when they may or may not have arrived, within `max_attempts`, `retry_backoff` and
    `max_retry_time`, as `Client` describes.
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
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=auth_headers(token), timeout=timeout
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def _send(self, operation: op.Operation) -> Any:
        retrying = op.Retrying(self._retry) if operation.idempotency_key is not None else None
        while True:
            try:
                response = await self._http.request(
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
            await anyio.sleep(delay)

    async def request(
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
            response = await self._http.request(
                method, path, params=params, json=json, content=content, headers=headers
            )
        except httpx.TransportError as error:
            raise TransportError(f"{method} {path}: {error}") from error
        return op.read_raw_answer(response.status_code, response.text)

    # Sessions and messages.

    async def create_session(
        self,
        agent: Optional[str] = None,
        metadata: Optional[Mapping[str, Any]] = None,
        *,
        idempotency_key: Optional[str] = None,
    ) -> models.SessionView:
        """Creates a session, sent with `idempotency_key` (a fresh UUID without one): see
        `Client.create_session`."""
        return await self._send(op.create_session(agent, metadata, idempotency_key))

    async def get_session(self, session_id: str) -> models.SessionView:
        return await self._send(op.get_session(session_id))

    async def list_sessions(
        self, cursor: Optional[str] = None, limit: Optional[int] = None, **filters: Any
    ) -> models.PageSessionView:
        """One page of sessions; `filters` are the API's (`order`, `status`, `agent`,
        `created_from`, `created_before`, `q`)."""
        return await self._send(op.list_sessions(cursor, limit, filters))

    async def archive_session(self, session_id: str) -> models.SessionView:
        return await self._send(op.archive_session(session_id))

    async def delete_session(self, session_id: str) -> None:
        await self._send(op.delete_session(session_id))

    async def send_message(
        self,
        session_id: str,
        content: str,
        multitask: str = "enqueue",
        *,
        idempotency_key: Optional[str] = None,
    ) -> models.MessageAccepted:
        """Sends a message; `multitask` says what happens when a run is active: `enqueue`,
        `reject`, `interrupt` or `steer`. It is sent with `idempotency_key` (a fresh UUID
        without one) and sent again with it when it may not have arrived: see
        `Client.send_message`."""
        return await self._send(op.send_message(session_id, content, multitask, idempotency_key))

    async def list_messages(
        self, session_id: str, cursor: Optional[str] = None, limit: Optional[int] = None
    ) -> models.PageMessageView:
        return await self._send(op.list_messages(session_id, cursor, limit))

    # Runs.

    async def get_run(self, run_id: str) -> models.RunView:
        return await self._send(op.get_run(run_id))

    async def list_runs(
        self, session_id: str, cursor: Optional[str] = None, limit: Optional[int] = None
    ) -> models.PageRunSummaryView:
        return await self._send(op.list_runs(session_id, cursor, limit))

    async def wait_run(self, run_id: str, timeout: float = 300.0) -> models.RunView:
        """Waits until the run has ended (`completed`, `failed`, `cancelled`) or waits for a
        person (`waiting_human`: an approval or reconciliation to answer; `paused`), and
        returns it as it then stands. Raises `WaitTimeout` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        interval = op.FIRST_POLL_INTERVAL
        while True:
            run = await self.get_run(run_id)
            if run.status in op.SETTLED_RUN_STATUSES:
                return run
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"run {run_id} is still {run.status} after {timeout:g} s")
            await anyio.sleep(min(interval, remaining))
            interval = min(interval * 2, op.MAX_POLL_INTERVAL)

    async def cancel(self, run_id: str) -> models.CancelView:
        return await self._send(op.cancel(run_id))

    async def pause(self, run_id: str) -> models.PauseView:
        return await self._send(op.pause(run_id))

    async def resume(self, run_id: str) -> models.ResumedView:
        return await self._send(op.resume(run_id))

    async def retry(self, run_id: str) -> models.ResumedView:
        return await self._send(op.retry(run_id))

    async def continue_run(
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
        return await self._send(op.continue_run(run_id, extra))

    async def reconcile(
        self, run_id: str, call_id: str, outcome: str, result: Optional[str] = None
    ) -> models.ReconcileView:
        """Answers for a call whose outcome is unknown: `succeeded`, `failed`, `retry` or
        `skip`."""
        return await self._send(op.reconcile(run_id, call_id, outcome, result))

    # Approvals.

    async def list_approvals(
        self,
        status: Optional[str] = None,
        cursor: Optional[str] = None,
        limit: Optional[int] = None,
    ) -> models.PageApprovalView:
        return await self._send(op.list_approvals(status, cursor, limit))

    async def get_approval(self, approval_id: str) -> models.ApprovalView:
        return await self._send(op.get_approval(approval_id))

    async def decide_approval(
        self,
        approval_id: str,
        decisions: Optional[Sequence[op.Decision]] = None,
        *,
        abort: bool = False,
    ) -> models.ApprovalView:
        """Answers an approval: `decisions`, one per call that needs approval
        (`{"call_id", "decision": "approve"|"deny", "note"?}`), or `abort=True` to end the run
        as cancelled."""
        return await self._send(op.decide_approval(approval_id, decisions, abort))

    # Webhooks.

    async def create_webhook(
        self,
        url: str,
        events: Optional[Sequence[str]] = None,
        secret: Optional[str] = None,
        max_attempts: Optional[int] = None,
    ) -> models.WebhookView:
        """Creates a webhook; the answer carries its signing secret, this once."""
        return await self._send(op.create_webhook(url, events, secret, max_attempts))

    async def list_webhooks(self) -> models.PageWebhookView:
        return await self._send(op.list_webhooks())

    async def get_webhook(self, webhook_id: str) -> models.WebhookView:
        return await self._send(op.get_webhook(webhook_id))

    async def delete_webhook(self, webhook_id: str) -> None:
        await self._send(op.delete_webhook(webhook_id))

    async def rotate_webhook_secret(
        self, webhook_id: str, secret: Optional[str] = None
    ) -> models.RotatedSecret:
        return await self._send(op.rotate_webhook_secret(webhook_id, secret))

    async def list_deliveries(
        self,
        webhook_id: str,
        status: Optional[str] = None,
        cursor: Optional[str] = None,
        limit: Optional[int] = None,
    ) -> models.PageDeliveryView:
        return await self._send(op.list_deliveries(webhook_id, status, cursor, limit))

    async def requeue_delivery(self, webhook_id: str, delivery_id: int) -> models.DeliveryView:
        return await self._send(op.requeue_delivery(webhook_id, delivery_id))

    async def requeue_dead_deliveries(self, webhook_id: str) -> models.RequeuedView:
        return await self._send(op.requeue_dead_deliveries(webhook_id))

    # Events.

    def events(
        self,
        session_id: str,
        after: Optional[int] = None,
        follow: bool = True,
        *,
        max_reconnect_time: Optional[float] = None,
    ) -> AsyncIterator[Event]:
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
    ) -> AsyncIterator[Event]:
        """The run's events: each stored one (`EventView`) exactly once, in `seq` order, and
        the live activity of its steps (`LiveActivityView`, no `seq`) while following.

        A dropped connection or a server restart is resumed with `Last-Event-ID`, waiting
        longer after each failed attempt, until `max_reconnect_time` seconds pass without a
        connection (`StreamDisconnected`). Without `follow` the iterator ends after the stored
        events; with it, it never ends by itself: stop iterating and `aclose()` it when done
        (`async with contextlib.aclosing(client.run_events(...)) as events:`).
        """
        path = op.run_events_path(run_id)
        return self._follow(path, after, follow, max_reconnect_time)

    async def _follow(
        self, path: str, after: Optional[int], follow: bool, max_reconnect_time: Optional[float]
    ) -> AsyncIterator[Event]:
        if max_reconnect_time is None:
            max_reconnect_time = self._max_reconnect_time
        resumption = Resumption(after, max_reconnect_time)
        params = {"follow": follow}
        while True:
            cause: Optional[BaseException] = None
            try:
                async with self._http.stream(
                    "GET",
                    path,
                    params=params,
                    headers=resumption.headers(),
                    timeout=stream_timeout(self._timeout),
                ) as response:
                    if response.status_code != 200:
                        await response.aread()
                        error = api_error(response.status_code, response.text)
                        if not is_retryable(error):
                            raise error
                        cause = error
                    else:
                        resumption.connected()
                        parser = SseParser()
                        async for line in response.aiter_lines():
                            sse = parser.feed(line)
                            event = resumption.accept(sse) if sse is not None else None
                            if event is not None:
                                yield event
                        if not follow:
                            return
            except httpx.TransportError as error:
                cause = error
            await anyio.sleep(resumption.reconnect_delay(cause))
