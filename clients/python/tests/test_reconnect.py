"""An event iterator survives its server's death: it reconnects with `Last-Event-ID` and
yields every event exactly once."""

from __future__ import annotations

from contextlib import closing

import pytest

from conftest import DEADLINE, SCRIPTS, Server, ratchet_bin, serve
from helpers import stored
from ratchet_client import Client, StreamDisconnected
from ratchet_client._sse import Resumption, ServerSentEvent
from ratchet_client.models import EventView


@pytest.fixture
def own_server(tmp_path) -> Server:
    """A server of the test's own, to kill: no tokens, and a short lease so that the
    restarted process takes the killed one's step over quickly."""
    server = serve(ratchet_bin(), tmp_path, "", SCRIPTS["adder"])
    server.args += ["--lease-ms", "1000"]
    server.start()
    yield server
    server.stop()


def test_a_stream_resumes_across_a_sigkill_and_restart(own_server: Server) -> None:
    with Client(own_server.url, timeout=DEADLINE, max_reconnect_time=DEADLINE) as client:
        session = client.create_session(agent="slow")
        run_id = client.send_message(session.id, "count").run_id

        followed = []
        seq_at_kill = None
        with closing(client.run_events(run_id)) as events:
            for event in events:
                followed.append(event)
                if not isinstance(event, EventView):
                    continue
                if seq_at_kill is None and event.kind == "step.committed":
                    seq_at_kill = event.seq
                    own_server.kill()
                    own_server.start()
                if event.kind == "run.finished":
                    break

        seqs = [event.seq for event in stored(followed)]
        assert seq_at_kill is not None and own_server.starts == 2
        assert seqs == list(range(1, len(seqs) + 1)), seqs
        assert seqs[-1] > seq_at_kill
        assert stored(followed)[-1].kind == "run.finished"
        assert stored(followed) == list(client.run_events(run_id, follow=False))
        assert client.get_run(run_id).final_answer == "all done now, the sum is five"


def test_a_stream_gives_up_after_its_reconnect_time(own_server: Server) -> None:
    with Client(own_server.url, timeout=DEADLINE) as client:
        session = client.create_session(agent="adder")
        client.wait_run(client.send_message(session.id, "add").run_id, timeout=DEADLINE)
        events = client.events(session.id, max_reconnect_time=1.0)
        first = next(events)
        own_server.kill()
        with pytest.raises(StreamDisconnected):
            for event in events:
                assert event.seq > first.seq


def sse(seq: int) -> ServerSentEvent:
    data = (
        f'{{"seq": {seq}, "session_id": "ses_a", "run_id": "run_a", "kind": "step.committed",'
        f' "payload": {{}}, "created_at": 0}}'
    )
    return ServerSentEvent("step.committed", data, str(seq))


def test_a_replay_that_overlaps_what_was_seen_yields_nothing_twice() -> None:
    resumption = Resumption(after=1, max_reconnect_time=1.0)
    delivered = [resumption.accept(sse(seq)) for seq in (1, 2, 3, 2, 3, 4)]
    assert [event.seq if event else None for event in delivered] == [None, 2, 3, None, None, 4]
    assert resumption.headers() == {"Last-Event-ID": "4"}
