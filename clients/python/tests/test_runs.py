"""Sessions, messages, runs and their control, through the sync client."""

from __future__ import annotations

from contextlib import closing

from conftest import DEADLINE
from helpers import stored, until_finished, until_kind
from ratchet_client import Client, Conflict, UnprocessableEntity
from ratchet_client.models import EventView, LiveActivityView


def test_a_message_runs_to_completion(client: Client) -> None:
    session = client.create_session(agent="adder", metadata={"purpose": "test"})
    assert session.agent == "adder" and session.metadata == {"purpose": "test"}

    accepted = client.send_message(session.id, "What is 2 + 3?")
    run = client.wait_run(accepted.run_id, timeout=DEADLINE)

    assert (run.status, run.stop_reason, run.final_answer) == ("completed", "completed", "The sum is 5.")
    assert run.usage.model_calls == 2 and run.usage.tool_calls == 1
    assert client.get_session(session.id).last_run_status == "completed"
    assert [r.id for r in client.list_runs(session.id).items] == [accepted.run_id]
    messages = client.list_messages(session.id).items
    assert (messages[0].role, messages[0].content) == ("user", "What is 2 + 3?")
    assert messages[-1].content == "The sum is 5."


def test_the_events_followed_live_are_the_stored_sequence(client: Client) -> None:
    session = client.create_session(agent="slow")
    run_id = client.send_message(session.id, "count").run_id

    with closing(client.events(session.id)) as events:
        followed = until_finished(events)
    replayed = list(client.events(session.id, follow=False))
    run_replayed = list(client.run_events(run_id, follow=False))

    assert stored(followed) == replayed == run_replayed
    assert [event.seq for event in replayed] == list(range(1, len(replayed) + 1))
    assert replayed[-1].kind == "run.finished"
    assert all(event.run_id == run_id for event in replayed)
    # A replay holds no live activity; the live stream announced the steps as they ran.
    assert all(isinstance(event, EventView) for event in replayed)
    activity = [event for event in followed if isinstance(event, LiveActivityView)]
    assert activity and all(event.live and event.run_id == run_id for event in activity)
    # A replay after a cursor starts right after it.
    middle = replayed[len(replayed) // 2].seq
    assert list(client.events(session.id, after=middle, follow=False)) == replayed[middle:]


def test_a_paused_run_resumes_where_it_stopped(client: Client) -> None:
    session = client.create_session(agent="slow")
    run_id = client.send_message(session.id, "count").run_id
    with closing(client.run_events(run_id)) as events:
        until_kind(events, "step.committed")

    assert client.pause(run_id).status in ("paused", "pausing")
    paused = client.wait_run(run_id, timeout=DEADLINE)
    assert paused.status == "paused"
    assert client.pause(run_id).status == "paused"

    assert client.resume(run_id).status == "running"
    finished = client.wait_run(run_id, timeout=DEADLINE)
    assert (finished.status, finished.final_answer) == ("completed", "all done now, the sum is five")
    kinds = [event.kind for event in client.run_events(run_id, follow=False)]
    assert kinds.count("run.finished") == 1


def test_a_cancelled_run_ends_cancelled_and_cannot_be_resumed(client: Client) -> None:
    session = client.create_session(agent="slow")
    run_id = client.send_message(session.id, "count").run_id

    assert client.cancel(run_id).status in ("cancelled", "cancelling")
    run = client.wait_run(run_id, timeout=DEADLINE)

    assert (run.status, run.stop_reason) == ("cancelled", "cancelled")
    try:
        client.resume(run_id)
    except Conflict as error:
        assert error.status == 409 and error.code == "conflict"
    else:
        raise AssertionError("resuming a cancelled run was accepted")


def test_a_run_that_spent_its_budget_is_continued_with_more(client: Client) -> None:
    session = client.create_session(agent="tight")
    run_id = client.send_message(session.id, "add").run_id
    failed = client.wait_run(run_id, timeout=DEADLINE)
    assert (failed.status, failed.stop_reason) == ("failed", "budget_exhausted")

    try:
        client.retry(run_id)
    except UnprocessableEntity as error:
        assert error.code == "invalid_request" and "continue" in error.message
    else:
        raise AssertionError("retrying a run that did not fail calling the model was accepted")

    assert client.continue_run(run_id, extra_steps=5).status == "running"
    run = client.wait_run(run_id, timeout=DEADLINE)
    assert (run.status, run.final_answer) == ("completed", "The sum is 5.")
    kinds = [event.kind for event in client.run_events(run_id, follow=False)]
    assert kinds.count("run.resumed") == 1 and kinds.count("run.finished") == 2


def test_a_run_that_failed_calling_the_model_is_retried(client: Client) -> None:
    session = client.create_session(agent="broken")
    run_id = client.send_message(session.id, "hello").run_id
    failed = client.wait_run(run_id, timeout=DEADLINE)
    assert (failed.status, failed.stop_reason) == ("failed", "llm_error")

    assert client.retry(run_id).status == "running"
    # The model is still unreachable: the fresh attempt fails the same way, one step later.
    again = client.wait_run(run_id, timeout=DEADLINE)
    assert (again.status, again.stop_reason) == ("failed", "llm_error")
    assert again.step_index == failed.step_index + 1
    kinds = [event.kind for event in client.run_events(run_id, follow=False)]
    assert kinds.count("model.error") == 2 and kinds.count("run.resumed") == 1
    assert kinds[-1] == "run.finished"
