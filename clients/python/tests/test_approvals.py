"""A tool call that needs approval: the run waits, a decision lets it go on."""

from __future__ import annotations

from contextlib import closing

import pytest

from conftest import DEADLINE
from helpers import until_kind
from ratchet_client import Client, Conflict


def waiting_approval(client: Client, run_id: str):
    with closing(client.run_events(run_id)) as events:
        required = until_kind(events, "approval.required")
    return client.get_approval(required.payload["approval_id"])


def test_an_approved_call_runs_and_the_run_completes(client: Client) -> None:
    session = client.create_session(agent="gated")
    run_id = client.send_message(session.id, "add").run_id

    approval = waiting_approval(client, run_id)
    waiting = client.wait_run(run_id, timeout=DEADLINE)
    assert waiting.status == "waiting_human" and waiting.pending_human is not None
    assert approval.status == "pending" and approval.run_id == run_id
    [call] = approval.calls
    assert (call.name, call.arguments, call.needs_approval) == ("add", {"a": 2, "b": 3}, True)
    assert approval.id in [a.id for a in client.list_approvals(status="pending", limit=200).items]

    decision = [{"call_id": call.call_id, "decision": "approve", "note": "fine"}]
    decided = client.decide_approval(approval.id, decision)
    assert decided.status == "decided" and decided.calls[0].decision == "approve"
    # The same answer again is accepted; a different one is a conflict.
    assert client.decide_approval(approval.id, decision).status == "decided"
    with pytest.raises(Conflict):
        client.decide_approval(approval.id, [{"call_id": call.call_id, "decision": "deny"}])

    run = client.wait_run(run_id, timeout=DEADLINE)
    assert (run.status, run.final_answer, run.usage.tool_calls) == ("completed", "The sum is 5.", 1)


def test_an_aborted_approval_cancels_its_run(client: Client) -> None:
    session = client.create_session(agent="gated")
    run_id = client.send_message(session.id, "add").run_id
    approval = waiting_approval(client, run_id)

    assert client.decide_approval(approval.id, abort=True).status == "aborted"
    run = client.wait_run(run_id, timeout=DEADLINE)
    assert (run.status, run.usage.tool_calls) == ("cancelled", 0)


def test_a_decision_needs_decisions_or_abort(client: Client) -> None:
    with pytest.raises(ValueError):
        client.decide_approval("apr_x")
    with pytest.raises(ValueError):
        client.decide_approval("apr_x", [], abort=True)
