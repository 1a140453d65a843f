"""Error answers become typed exceptions carrying the API's code and message; tokens are
required and tenants are kept apart."""

from __future__ import annotations

import pytest

from conftest import DEADLINE, TOKENS, Server
from ratchet_client import (
    ApiError,
    BadRequest,
    Client,
    Conflict,
    NotFound,
    RatchetError,
    TransportError,
    Unauthorized,
    UnprocessableEntity,
)


def test_an_unknown_run_is_not_found(client: Client) -> None:
    with pytest.raises(NotFound) as raised:
        client.get_run("run_00000000-0000-0000-0000-000000000000")
    error = raised.value
    assert isinstance(error, ApiError) and isinstance(error, RatchetError)
    assert (error.status, error.code) == (404, "not_found")
    assert "run_00000000-0000-0000-0000-000000000000" in error.message
    assert error.body == {"error": {"code": "not_found", "message": error.message}}


def test_a_malformed_body_or_id_is_a_bad_request(client: Client) -> None:
    with pytest.raises(BadRequest) as malformed_json:
        client.request(
            "POST", "/v1/sessions", content=b'{"agent": ', headers={"Content-Type": "application/json"}
        )
    assert (malformed_json.value.status, malformed_json.value.code) == (400, "bad_request")
    assert malformed_json.value.message

    with pytest.raises(BadRequest) as malformed_id:
        client.get_run("not-a-run-id")
    assert malformed_id.value.code == "bad_request" and malformed_id.value.message


def test_a_body_the_server_refuses_is_unprocessable(client: Client) -> None:
    session = client.create_session()
    with pytest.raises(UnprocessableEntity) as empty:
        client.send_message(session.id, "   ")
    assert (empty.value.status, empty.value.code) == (422, "invalid_request")

    with pytest.raises(UnprocessableEntity) as unknown_agent:
        client.create_session(agent="nobody")
    # The message lists the agents there are.
    assert "adder" in unknown_agent.value.message


def test_a_busy_session_rejects_a_message_sent_with_reject(client: Client) -> None:
    session = client.create_session(agent="slow")
    run_id = client.send_message(session.id, "count").run_id
    with pytest.raises(Conflict) as busy:
        client.send_message(session.id, "again", multitask="reject")
    assert busy.value.code == "conflict"
    client.cancel(run_id)
    assert client.wait_run(run_id, timeout=DEADLINE).status == "cancelled"


def test_every_request_needs_a_known_token(server: Server) -> None:
    for token in (None, "not-a-known-token-at-all"):
        with Client(server.url, token=token) as anonymous:
            with pytest.raises(Unauthorized) as refused:
                anonymous.list_sessions()
            assert (refused.value.status, refused.value.code) == (401, "unauthorized")
            with pytest.raises(Unauthorized):
                list(anonymous.events("ses_00000000-0000-0000-0000-000000000000", follow=False))


def test_another_tenants_session_is_not_found(server: Server, client: Client) -> None:
    session = client.create_session()
    with Client(server.url, token=TOKENS["globex"]) as globex:
        with pytest.raises(NotFound):
            globex.get_session(session.id)
        assert session.id not in [s.id for s in globex.list_sessions(limit=200).items]


def test_an_unreachable_server_is_a_transport_error() -> None:
    with Client("http://127.0.0.1:9", timeout=2) as nowhere:
        with pytest.raises(TransportError):
            nowhere.list_sessions()
