"""What several tests do with event iterators."""

from __future__ import annotations

from typing import Iterable, List

from ratchet_client.models import EventView


def stored(events: Iterable[object]) -> List[EventView]:
    return [event for event in events if isinstance(event, EventView)]


def until_finished(events: Iterable[object]) -> List[object]:
    """Everything the iterator yields up to and including the first `run.finished`."""
    seen: List[object] = []
    for event in events:
        seen.append(event)
        if isinstance(event, EventView) and event.kind == "run.finished":
            return seen
    raise AssertionError(f"the stream ended without run.finished after {len(seen)} events")


def until_kind(events: Iterable[object], kind: str) -> EventView:
    """The first stored event of `kind`."""
    for event in events:
        if isinstance(event, EventView) and event.kind == kind:
            return event
    raise AssertionError(f"the stream ended without {kind}")
