"""`create_session` and `send_message` send an `Idempotency-Key`: a message sent again with
its key is taken once, and a request that may or may not have arrived is sent again with the
same key, so that it is carried out once."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator, List, Optional, Tuple

import httpx
import pytest

from conftest import DEADLINE, TOKENS, Server
from ratchet_client import AsyncClient, Client, Conflict, TransportError, UnprocessableEntity


def runs_of(client: Client, session_id: str) -> List[str]:
    return [run.id for run in client.list_runs(session_id, limit=50).items]


def test_a_message_sent_again_with_its_key_is_taken_once(client: Client) -> None:
    session = client.create_session(agent="adder")
    key = f"message-{uuid.uuid4()}"
    first = client.send_message(session.id, "What is 2 + 3?", idempotency_key=key)
    again = client.send_message(session.id, "What is 2 + 3?", idempotency_key=key)

    assert again == first
    assert runs_of(client, session.id) == [first.run_id]
    assert client.wait_run(first.run_id, timeout=DEADLINE).final_answer == "The sum is 5."
    assert [m.content for m in client.list_messages(session.id).items if m.role == "user"] == [
        "What is 2 + 3?"
    ]


def test_a_session_created_again_with_its_key_is_the_same_session(client: Client) -> None:
    key = f"session-{uuid.uuid4()}"
    first = client.create_session(agent="adder", idempotency_key=key)
    again = client.create_session(agent="adder", idempotency_key=key)
    assert again.id == first.id


def test_a_key_sent_again_with_another_message_is_refused(client: Client) -> None:
    session = client.create_session(agent="adder")
    key = f"message-{uuid.uuid4()}"
    accepted = client.send_message(session.id, "What is 2 + 3?", idempotency_key=key)
    with pytest.raises(UnprocessableEntity) as refused:
        client.send_message(session.id, "What is 3 + 4?", idempotency_key=key)
    assert (refused.value.status, refused.value.code) == (422, "invalid_request")
    assert runs_of(client, session.id) == [accepted.run_id]


def test_every_call_without_a_key_sends_a_fresh_one(client: Client) -> None:
    keys: List[Optional[str]] = []
    client._http.event_hooks["request"].append(
        lambda request: keys.append(request.headers.get("Idempotency-Key"))
    )
    session = client.create_session(agent="adder")
    first = client.send_message(session.id, "What is 2 + 3?")
    second = client.send_message(session.id, "What is 2 + 3?")

    assert len(keys) == 3 and len(set(keys)) == 3, keys
    assert all(uuid.UUID(str(key)).version == 4 for key in keys)
    assert first.run_id != second.run_id
    assert sorted(runs_of(client, session.id)) == sorted([first.run_id, second.run_id])
    # Reads are not keyed.
    assert keys[-1] is None


class DroppingProxy:
    """A TCP proxy in front of the server. The first request of each of the first `drops`
    connections reaches the server, which carries it out and answers, but the connection is
    then reset without passing the answer on: the client cannot know whether its request
    arrived. Every other connection is passed through. `keys` holds the `Idempotency-Key` of
    each connection's first request."""

    def __init__(self, upstream: Server, drops: int = 1) -> None:
        self.upstream_port = upstream.port
        self.drops = drops
        self.keys: List[Optional[str]] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def close(self) -> None:
        self._closed.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                downstream, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(downstream,), daemon=True).start()

    def _serve(self, downstream: socket.socket) -> None:
        downstream.settimeout(DEADLINE)
        head, body = read_request(downstream)
        self.keys.append(header_of(head, "idempotency-key"))
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=DEADLINE)
        upstream.sendall(head + body)
        if self.drops > 0:
            self.drops -= 1
            # The answer's first bytes: the server has carried the request out and kept its
            # answer with the key.
            upstream.recv(65536)
            upstream.close()
            downstream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            downstream.close()
            return
        threading.Thread(target=pipe, args=(upstream, downstream), daemon=True).start()
        pipe(downstream, upstream)


def read_request(connection: socket.socket) -> Tuple[bytes, bytes]:
    """One HTTP request's head and its body (by `Content-Length`)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            raise ConnectionError("the client closed before a whole request")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(header_of(head, "content-length") or 0)
    while len(body) < length:
        body += connection.recv(65536)
    return head + b"\r\n\r\n", body


def header_of(head: bytes, name: str) -> Optional[str]:
    for line in head.decode("latin-1").split("\r\n")[1:]:
        field, _, value = line.partition(":")
        if field.strip().lower() == name:
            return value.strip()
    return None


def pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while True:
            chunk = source.recv(65536)
            if not chunk:
                break
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def proxy(server: Server) -> Iterator[DroppingProxy]:
    proxy = DroppingProxy(server)
    yield proxy
    proxy.close()


def test_a_message_whose_answer_was_lost_is_sent_again_with_its_key(
    client: Client, proxy: DroppingProxy
) -> None:
    session = client.create_session(agent="adder")
    with Client(proxy.url, token=TOKENS["acme"], timeout=DEADLINE) as through_proxy:
        accepted = through_proxy.send_message(session.id, "What is 2 + 3?")

    assert proxy.drops == 0 and len(proxy.keys) == 2
    assert proxy.keys[0] is not None and proxy.keys[1] == proxy.keys[0]
    assert runs_of(client, session.id) == [accepted.run_id]
    assert client.wait_run(accepted.run_id, timeout=DEADLINE).final_answer == "The sum is 5."


def test_a_session_whose_answer_was_lost_is_created_once(
    client: Client, proxy: DroppingProxy
) -> None:
    marker = f"created-once-{uuid.uuid4()}"
    since = int(time.time() * 1000) - 1
    with Client(proxy.url, token=TOKENS["acme"], timeout=DEADLINE) as through_proxy:
        session = through_proxy.create_session(agent="adder", metadata={"marker": marker})
    assert len(proxy.keys) == 2 and proxy.keys[1] == proxy.keys[0]
    listed = client.list_sessions(limit=200, created_from=since).items
    assert [s.id for s in listed if (s.metadata or {}).get("marker") == marker] == [session.id]


def test_without_retries_a_lost_answer_is_a_transport_error(
    client: Client, proxy: DroppingProxy
) -> None:
    session = client.create_session(agent="adder")
    key = f"lost-once-{uuid.uuid4()}"
    with Client(proxy.url, token=TOKENS["acme"], max_attempts=1) as once:
        with pytest.raises(TransportError):
            once.send_message(session.id, "What is 2 + 3?", idempotency_key=key)
    # It arrived all the same: sent again with its key, it answers the run it started.
    [run_id] = runs_of(client, session.id)
    assert client.send_message(session.id, "What is 2 + 3?", idempotency_key=key).run_id == run_id
    assert runs_of(client, session.id) == [run_id]


@pytest.mark.anyio
async def test_the_async_client_sends_a_lost_message_again_with_its_key(
    server: Server, proxy: DroppingProxy
) -> None:
    async with AsyncClient(server.url, token=TOKENS["acme"], timeout=DEADLINE) as client:
        session = await client.create_session(agent="adder")
        key = f"async-{uuid.uuid4()}"
        async with AsyncClient(proxy.url, token=TOKENS["acme"], timeout=DEADLINE) as through_proxy:
            accepted = await through_proxy.send_message(session.id, "What is 2 + 3?", idempotency_key=key)
        assert proxy.keys == [key, key]
        assert [r.id for r in (await client.list_runs(session.id)).items] == [accepted.run_id]
        again = await client.send_message(session.id, "What is 2 + 3?", idempotency_key=key)
        assert again == accepted

        first = await client.send_message(session.id, "And again?")
        second = await client.send_message(session.id, "And again?")
        assert first.run_id != second.run_id
        with pytest.raises(UnprocessableEntity) as refused:
            await client.send_message(session.id, "Something else", idempotency_key=key)
        assert refused.value.code == "invalid_request"
        assert len((await client.list_runs(session.id)).items) == 3


class InProgressOnce(BaseHTTPRequestHandler):
    """Answers its first `POST` `409 request_in_progress` with `Retry-After: 1` (or, with
    `slow`, not at all within two seconds), the next one as the server would once the first
    is done."""

    posts: List[Tuple[float, Optional[str]]] = []
    slow = False

    def do_POST(self) -> None:  # noqa: N802 (the handler's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.posts.append((time.monotonic(), self.headers.get("Idempotency-Key")))
        if len(self.posts) == 1 and self.slow:
            time.sleep(2)  # longer than the client waits: it has given up on this connection
        elif len(self.posts) == 1:
            body = {"error": {"code": "request_in_progress", "message": "still carried out"}}
            self._answer(409, body, {"Retry-After": "1"})
        else:
            body = {"message_id": "msg_1", "run_id": "run_1", "run_status": "queued", "steered": False}
            self._answer(201, body, {"Idempotent-Replayed": "true"})

    def _answer(self, status: int, body: dict, headers: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in {**headers, "Content-Type": "application/json"}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def in_progress_once() -> Iterator[str]:
    InProgressOnce.posts = []
    InProgressOnce.slow = False
    http = ThreadingHTTPServer(("127.0.0.1", 0), InProgressOnce)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{http.server_address[1]}"
    http.shutdown()
    http.server_close()


def test_a_request_in_progress_is_sent_again_after_its_retry_after(in_progress_once: str) -> None:
    with Client(in_progress_once) as client:
        accepted = client.send_message("ses_a", "hello", idempotency_key="in-progress")
    assert accepted.run_id == "run_1"
    (first_at, first_key), (second_at, second_key) = InProgressOnce.posts
    assert first_key == second_key == "in-progress"
    assert second_at - first_at >= 0.95


def test_a_request_still_in_progress_when_the_time_is_spent_raises_its_conflict(
    in_progress_once: str,
) -> None:
    with Client(in_progress_once, max_retry_time=0.0) as client:
        with pytest.raises(Conflict) as busy:
            client.send_message("ses_a", "hello")
    assert busy.value.code == "request_in_progress"
    assert len(InProgressOnce.posts) == 1


def test_a_request_that_timed_out_is_sent_again_with_its_key(in_progress_once: str) -> None:
    InProgressOnce.slow = True
    with Client(in_progress_once, timeout=0.5) as client:
        accepted = client.send_message("ses_a", "hello")
    assert accepted.run_id == "run_1"
    (_, first_key), (_, second_key) = InProgressOnce.posts
    assert first_key is not None and second_key == first_key


def test_an_unreachable_server_is_tried_a_bounded_number_of_times() -> None:
    attempts = []
    with Client("http://127.0.0.1:9", retry_backoff=0.01) as nowhere:
        nowhere._http.event_hooks["request"].append(lambda request: attempts.append(request))
        started = time.monotonic()
        with pytest.raises(TransportError):
            nowhere.create_session()
    assert len(attempts) == 4
    assert time.monotonic() - started < 5
    assert len({request.headers["Idempotency-Key"] for request in attempts}) == 1
    assert isinstance(attempts[0], httpx.Request)
