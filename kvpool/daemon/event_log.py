"""A bounded, numbered log of a node's KV events, with blocking readers.

Events are numbered 1, 2, 3, ... per node. The log keeps the last ``capacity_events``;
a subscriber that asks for an older seq receives the oldest kept event, sees the gap
and resyncs from a snapshot.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Iterator

from kvpool.core.events import EventKind, KVEvent


class EventLog:
    def __init__(self, node_id: str, capacity_events: int = 100_000) -> None:
        self.node_id = node_id
        self._events: collections.deque[KVEvent] = collections.deque(maxlen=capacity_events)
        self._last_seq = 0
        self._cond = threading.Condition()
        self._closed = False

    @property
    def last_seq(self) -> int:
        with self._cond:
            return self._last_seq

    def append(
        self, kind: EventKind, hashes: list[bytes], namespace: bytes, block_tokens: int = 0, tier: str = "host"
    ) -> int:
        """Number and keep one event. ``tier`` is where the blocks now live ("host", "disk",
        "device"): a tiered store reports a block demoted to disk as STORED on "disk"."""
        with self._cond:
            self._last_seq += 1
            self._events.append(
                KVEvent(self.node_id, self._last_seq, kind, tuple(hashes), tier, namespace, b"", block_tokens)
            )
            self._cond.notify_all()
            return self._last_seq

    def read_from(self, from_seq: int, wait_s: float) -> list[KVEvent]:
        """Events with seq >= from_seq (or the oldest kept, if those are gone); waits up to
        ``wait_s`` for one to arrive."""
        with self._cond:
            if self._last_seq < from_seq and not self._closed:
                self._cond.wait(wait_s)
            if not self._events or self._last_seq < from_seq:
                return []
            first = self._events[0].seq
            start = max(0, from_seq - first)
            # slice without copying the whole log (up to capacity_events) on every poll
            return list(itertools.islice(self._events, start, None))

    def follow(self, from_seq: int, is_active: collections.abc.Callable[[], bool]) -> Iterator[KVEvent]:
        """Yield events from ``from_seq`` on, until ``is_active()`` turns false or the log closes."""
        next_seq = max(from_seq, 1)
        while is_active() and not self._closed:
            for event in self.read_from(next_seq, wait_s=0.5):
                yield event
                next_seq = event.seq + 1

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
