"""Server-Sent Events: parsing a stream's lines, and resuming it without losing or repeating
an event.

The sync and async clients read the bytes; everything they decide about what to yield and
when to reconnect is here, so that both behave the same.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Union

from .errors import ApiError, StreamDisconnected
from .models import EventView, LiveActivityView

#: What an event iterator yields: a stored event (it has a `seq`), or the live activity of a
#: step in flight (no `seq`, never stored, never replayed).
Event = Union[EventView, LiveActivityView]

#: The first wait before reconnecting; it doubles after each failed attempt, up to the cap.
FIRST_RECONNECT_DELAY = 0.1
MAX_RECONNECT_DELAY = 2.0


@dataclass
class ServerSentEvent:
    event: str
    data: str
    id: Optional[str]


@dataclass
class SseParser:
    """Turns the lines of a `text/event-stream` into events, as the HTML standard reads them.

    Comments (the server's keep-alives) and `retry:` fields are passed over; an event's `id`
    is the one its own block names, so a block without one can be told apart.
    """

    _data: List[str] = field(default_factory=list)
    _event: str = ""
    _id: Optional[str] = None
    _has_fields: bool = False

    def feed(self, line: str) -> Optional[ServerSentEvent]:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._has_fields = True
        elif name == "event":
            self._event = value
            self._has_fields = True
        elif name == "id" and "\0" not in value:
            self._id = value
            self._has_fields = True
        return None

    def _dispatch(self) -> Optional[ServerSentEvent]:
        ready = self._has_fields and bool(self._data)
        event = ServerSentEvent(self._event or "message", "\n".join(self._data), self._id)
        self._data, self._event, self._id, self._has_fields = [], "", None, False
        return event if ready else None


def is_retryable(error: ApiError) -> bool:
    """Whether opening a stream may succeed later: the server is busy or not ready yet."""
    return error.status == 429 or error.status >= 500


class Resumption:
    """Where an event stream stands: the last `seq` yielded, and the reconnection budget.

    `accept` yields each stored event once, in order: an event whose `seq` is not above the
    last one yielded (the replay of a reconnection overlapping what was seen) is dropped. Live
    activity passes through without moving the cursor.
    """

    def __init__(
        self,
        after: Optional[int],
        max_reconnect_time: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.last_seq = after
        self._max_reconnect_time = max_reconnect_time
        self._clock = clock
        self._delay = FIRST_RECONNECT_DELAY
        self._disconnected_since: Optional[float] = None

    def headers(self) -> Dict[str, str]:
        return {} if self.last_seq is None else {"Last-Event-ID": str(self.last_seq)}

    def connected(self) -> None:
        self._delay = FIRST_RECONNECT_DELAY
        self._disconnected_since = None

    def accept(self, sse: ServerSentEvent) -> Optional[Event]:
        data = json.loads(sse.data)
        if not isinstance(data, dict):
            return None
        if data.get("seq") is None:
            return LiveActivityView.model_validate(data)
        event = EventView.model_validate(data)
        if self.last_seq is not None and event.seq <= self.last_seq:
            return None
        self.last_seq = event.seq
        return event

    def reconnect_delay(self, cause: Optional[BaseException]) -> float:
        """How long to wait before the next attempt; raises `StreamDisconnected` once the
        stream has been disconnected for longer than the caller allows."""
        now = self._clock()
        if self._disconnected_since is None:
            self._disconnected_since = now
        remaining = self._disconnected_since + self._max_reconnect_time - now
        if remaining <= 0:
            raise StreamDisconnected(
                f"no connection to the event stream for {self._max_reconnect_time:g} s "
                f"(last seq seen: {self.last_seq}): {cause or 'the server ended the stream'}"
            ) from cause
        delay = min(self._delay, remaining)
        self._delay = min(self._delay * 2, MAX_RECONNECT_DELAY)
        return delay
