"""A bounded, numbered log of a node's KV events, with blocking readers.

Events are numbered 1, 2, 3, ... per node, and also 1, 2, 3, ... per namespace. A
tenant's subscription (``namespace=``) sees only its namespace's events, numbered in that
namespace's own sequence, so it can still tell a gap (resync) from other tenants' traffic
and learns nothing of the other tenants' hashes. The all-namespace view (``namespace=None``,
node-wide numbers) is for the node's own cluster agent and for admin calls.

The log keeps the last ``capacity_events``; a subscriber that asks for an older seq receives
the oldest kept event, sees the gap and resyncs from a snapshot. Per-namespace counters are
kept for at most ``max_namespaces_tracked`` namespaces (least recently written dropped first;
a namespace dropped and seen again restarts at 1, which its subscribers see as a gap).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterator

from kvpool.core.events import EventKind, KVEvent

MAX_NAMESPACES_TRACKED = 65_536


class EventLog:
    def __init__(
        self, node_id: str, capacity_events: int = 100_000, max_namespaces_tracked: int = MAX_NAMESPACES_TRACKED
    ) -> None:
        self.node_id = node_id
        # (event with its node-wide seq, its seq within its namespace)
        self._events: collections.deque[tuple[KVEvent, int]] = collections.deque(maxlen=capacity_events)
        self._last_seq = 0
        self._ns_last: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._max_ns = max_namespaces_tracked
        self._cond = threading.Condition()
        self._closed = False

    @property
    def last_seq(self) -> int:
        with self._cond:
            return self._last_seq

    def last_seq_of(self, namespace: bytes) -> int:
        """The seq of ``namespace``'s latest event (0 if none)."""
        with self._cond:
            return self._ns_last.get(namespace, 0)

    def append(
        self, kind: EventKind, hashes: list[bytes], namespace: bytes, block_tokens: int = 0, tier: str = "host"
    ) -> int:
        """Number and keep one event. ``tier`` is where the blocks now live ("host", "disk",
        "device"): a tiered store reports a block demoted to disk as STORED on "disk"."""
        with self._cond:
            self._last_seq += 1
            ns_seq = self._ns_last.pop(namespace, 0) + 1
            self._ns_last[namespace] = ns_seq
            while len(self._ns_last) > self._max_ns:
                self._ns_last.popitem(last=False)
            event = KVEvent(self.node_id, self._last_seq, kind, tuple(hashes), tier, namespace, b"", block_tokens)
            self._events.append((event, ns_seq))
            self._cond.notify_all()
            return self._last_seq

    def read_from(self, from_seq: int, wait_s: float, namespace: bytes | None = None) -> list[KVEvent]:
        """Events with seq >= from_seq (or the oldest kept, if those are gone); waits up to
        ``wait_s`` for one to arrive. With ``namespace``: only its events, with its seqs."""
        with self._cond:
            if namespace is not None:
                return self._read_scoped(from_seq, wait_s, namespace)
            if self._last_seq < from_seq and not self._closed:
                self._cond.wait(wait_s)
            if not self._events or self._last_seq < from_seq:
                return []
            first = self._events[0][0].seq
            start = max(0, from_seq - first)
            # slice without copying the whole log (up to capacity_events) on every poll
            return [event for event, _ in itertools.islice(self._events, start, None)]

    def _read_scoped(self, from_seq: int, wait_s: float, namespace: bytes) -> list[KVEvent]:
        """Called under the lock. Walks back from the newest event only as far as the first
        of this namespace's events the reader already has (or the oldest kept)."""
        if self._ns_last.get(namespace, 0) < from_seq and not self._closed:
            self._cond.wait(wait_s)
        if self._ns_last.get(namespace, 0) < from_seq:
            return []
        picked: list[KVEvent] = []
        for event, ns_seq in reversed(self._events):
            if event.namespace != namespace:
                continue
            if ns_seq < from_seq:
                break
            picked.append(dataclasses.replace(event, seq=ns_seq))
        picked.reverse()
        return picked

    def follow(self, from_seq: int, is_active: Callable[[], bool], namespace: bytes | None = None) -> Iterator[KVEvent]:
        """Yield events from ``from_seq`` on, until ``is_active()`` turns false or the log closes."""
        next_seq = max(from_seq, 1)
        while is_active() and not self._closed:
            for event in self.read_from(next_seq, wait_s=0.5, namespace=namespace):
                yield event
                next_seq = event.seq + 1

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
