"""The exceptions the client raises.

Every one derives from `RatchetError`. An answer with an error status becomes an `ApiError`
(or the subclass for its status) carrying the `code` and `message` of the API's JSON error
body, `{"error": {"code": ..., "message": ...}}`.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Type


class RatchetError(Exception):
    """Base of every error this client raises."""


class TransportError(RatchetError):
    """The server could not be reached, or the connection broke before an answer."""


class StreamDisconnected(RatchetError):
    """An event stream lost its connection and could not reconnect within its time limit."""


class WaitTimeout(RatchetError):
    """`wait_run` gave up before the run settled."""


class ApiError(RatchetError):
    """The server answered with an error status.

    `code` is the API's stable machine-readable code (`not_found`, `conflict`, ...),
    `message` its explanation, `problems` the list some errors carry (a rejected reload) and
    `body` the decoded JSON body (or the raw text when it was not JSON).
    """

    def __init__(self, status: int, code: str, message: str, body: Any = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body = body

    @property
    def problems(self) -> List[str]:
        detail = self.body.get("error") if isinstance(self.body, dict) else None
        problems = detail.get("problems") if isinstance(detail, dict) else None
        return list(problems) if isinstance(problems, list) else []


class BadRequest(ApiError):
    """400: malformed JSON, a malformed id, a bad query parameter or cursor."""


class Unauthorized(ApiError):
    """401: a missing, malformed or unknown token."""


class Forbidden(ApiError):
    """403: a token that may not do this, or a refused browser origin."""


class NotFound(ApiError):
    """404: an unknown id (or another tenant's), an unknown route."""


class MethodNotAllowed(ApiError):
    """405: a known path with the wrong method."""


class Conflict(ApiError):
    """409: the request does not fit the current state (a busy session, an answered approval...)."""


class PayloadTooLarge(ApiError):
    """413: a body over 1 MiB."""


class UnsupportedMediaType(ApiError):
    """415: a body without `Content-Type: application/json`."""


class MisdirectedRequest(ApiError):
    """421: the request named a host the server does not answer to."""


class UnprocessableEntity(ApiError):
    """422: a well-formed body the server refuses (wrong types, unknown fields, an unknown agent...)."""


class TooManyRequests(ApiError):
    """429: a run quota or a steering cap is exceeded; nothing was recorded."""


class ServerError(ApiError):
    """5xx: the server could not answer (shutting down, or a bug it logged)."""


_BY_STATUS: Dict[int, Type[ApiError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    405: MethodNotAllowed,
    409: Conflict,
    413: PayloadTooLarge,
    415: UnsupportedMediaType,
    421: MisdirectedRequest,
    422: UnprocessableEntity,
    429: TooManyRequests,
}


def api_error(status: int, text: str) -> ApiError:
    """The exception for an error answer, from its status and body text."""
    body: Any
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = text
    detail = body.get("error") if isinstance(body, dict) else None
    code: Optional[str] = None
    message: Optional[str] = None
    if isinstance(detail, dict):
        code = detail.get("code") if isinstance(detail.get("code"), str) else None
        message = detail.get("message") if isinstance(detail.get("message"), str) else None
    cls = _BY_STATUS.get(status, ServerError if status >= 500 else ApiError)
    return cls(
        status,
        code or f"http_{status}",
        message or (text.strip() if text else f"HTTP {status}"),
        body,
    )
