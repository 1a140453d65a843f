"""A client of Ratchet's HTTP API.

`Client` is synchronous, `AsyncClient` the same methods awaited. Answers are the pydantic
models of `ratchet_client.models`, generated from the server's OpenAPI document; errors are
the exceptions of `ratchet_client.errors`, all `RatchetError`s.
"""

from . import models
from ._sse import Event
from .async_client import AsyncClient
from .client import Client
from .errors import (
    ApiError,
    BadRequest,
    Conflict,
    Forbidden,
    MethodNotAllowed,
    MisdirectedRequest,
    NotFound,
    PayloadTooLarge,
    RatchetError,
    ServerError,
    StreamDisconnected,
    TooManyRequests,
    TransportError,
    Unauthorized,
    UnprocessableEntity,
    UnsupportedMediaType,
    WaitTimeout,
)

__all__ = [
    "ApiError",
    "AsyncClient",
    "BadRequest",
    "Client",
    "Conflict",
    "Event",
    "Forbidden",
    "MethodNotAllowed",
    "MisdirectedRequest",
    "NotFound",
    "PayloadTooLarge",
    "RatchetError",
    "ServerError",
    "StreamDisconnected",
    "TooManyRequests",
    "TransportError",
    "Unauthorized",
    "UnprocessableEntity",
    "UnsupportedMediaType",
    "WaitTimeout",
    "models",
]
