"""The async client: the same operations, awaited, and its event iterator."""

from __future__ import annotations

from contextlib import aclosing

import pytest

from conftest import DEADLINE, TOKENS, Server
from ratchet_client import AsyncClient, NotFound, Unauthorized
from ratchet_client.models import EventView

pytestmark = pytest.mark.anyio


async def test_a_message_runs_to_completion_and_its_events_stream(server: Server) -> None:
    async with AsyncClient(server.url, token=TOKENS["acme"], timeout=DEADLINE) as client:
        session = await client.create_session(agent="adder")
        accepted = await client.send_message(session.id, "What is 2 + 3?")

        followed = []
        async with aclosing(client.run_events(accepted.run_id)) as events:
            async for event in events:
                followed.append(event)
                if isinstance(event, EventView) and event.kind == "run.finished":
                    break
        run = await client.wait_run(accepted.run_id, timeout=DEADLINE)
        replayed = [event async for event in client.events(session.id, follow=False)]

        assert (run.status, run.final_answer) == ("completed", "The sum is 5.")
        assert [e for e in followed if isinstance(e, EventView)] == replayed
        assert [e.seq for e in replayed] == list(range(1, len(replayed) + 1))
        assert [r.id for r in (await client.list_runs(session.id)).items] == [accepted.run_id]
        with pytest.raises(NotFound) as unknown:
            await client.get_run("run_00000000-0000-0000-0000-000000000000")
        assert unknown.value.code == "not_found"


async def test_the_async_client_sends_its_token(server: Server) -> None:
    async with AsyncClient(server.url) as anonymous:
        with pytest.raises(Unauthorized) as refused:
            await anonymous.get_session("ses_00000000-0000-0000-0000-000000000000")
        assert refused.value.code == "unauthorized"
