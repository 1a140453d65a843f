"""Webhooks: created, listed, rotated, their deliveries to a real receiver dead-lettered,
requeued and delivered, then deleted."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator, List, Tuple

import pytest

from conftest import DEADLINE
from ratchet_client import Client, NotFound, UnprocessableEntity


class Receiver:
    """An HTTP server on loopback that answers every POST with `status` and keeps what it got."""

    def __init__(self) -> None:
        self.status = 500
        self.received: List[Tuple[dict, bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/hook"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.http.shutdown()
    receiver.http.server_close()


def eventually(what: str, check: Callable[[], object]) -> object:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not within {DEADLINE} s: {what}")


def test_a_webhooks_life(client: Client, receiver: Receiver) -> None:
    created = client.create_webhook(
        receiver.url, events=["run.finished"], secret="first-secret-0123456789", max_attempts=1
    )
    assert created.secret == "first-secret-0123456789" and created.events == ["run.finished"]
    assert created.url == receiver.url and created.max_attempts == 1
    listed = client.list_webhooks().items
    assert created.id in [w.id for w in listed] and all(w.secret is None for w in listed)
    assert client.get_webhook(created.id).secret is None

    rotated = client.rotate_webhook_secret(created.id, "second-secret-0123456789")
    assert (rotated.id, rotated.secret) == (created.id, "second-secret-0123456789")
    assert client.rotate_webhook_secret(created.id).secret.startswith("whsec_")
    secret = client.rotate_webhook_secret(created.id, "third-secret-0123456789").secret

    session = client.create_session(agent="adder")
    run_id = client.send_message(session.id, "add").run_id
    assert client.wait_run(run_id, timeout=DEADLINE).status == "completed"

    def delivery(status: str):
        items = client.list_deliveries(created.id, status=status, limit=200).items
        return next((d for d in items if d.session_id == session.id), None)

    dead = eventually("the refused delivery is dead-lettered", lambda: delivery("dead_letter"))
    assert (dead.event_kind, dead.attempts, dead.last_status) == ("run.finished", 1, 500)

    headers, body = next(
        (headers, body)
        for headers, body in receiver.received
        if json.loads(body)["event"]["run_id"] == run_id
    )
    signed_at, signature = (part.split("=", 1)[1] for part in headers["ratchet-signature"].split(","))
    expected = hmac.new(secret.encode(), f"{signed_at}.".encode() + body, hashlib.sha256).hexdigest()
    assert signature == expected
    sent = json.loads(body)
    assert (sent["webhook_id"], sent["event"]["run_id"], sent["event"]["kind"]) == (
        created.id,
        run_id,
        "run.finished",
    )

    receiver.status = 204
    requeued = client.requeue_delivery(created.id, dead.id)
    assert requeued.id == dead.id and requeued.status != "dead_letter" and requeued.requeued_at
    delivered = eventually("the requeued delivery is delivered", lambda: delivery("delivered"))
    assert (delivered.id, delivered.last_status) == (dead.id, 204)
    assert client.requeue_dead_deliveries(created.id).requeued == 0

    client.delete_webhook(created.id)
    with pytest.raises(NotFound):
        client.get_webhook(created.id)


def test_a_webhook_with_an_unknown_event_kind_is_refused(client: Client, receiver: Receiver) -> None:
    with pytest.raises(UnprocessableEntity) as refused:
        client.create_webhook(receiver.url, events=["run.exploded"])
    assert "run.finished" in refused.value.message
