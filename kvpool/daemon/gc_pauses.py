"""Keep the block index out of the garbage collector's full passes (``--gc-freeze``).

CPython's full (generation 2) collection walks every object it tracks, and the store's
index holds one per block (``storage.host_types.Entry``) plus its eviction order: with a
million blocks a full pass takes ~0.2 s on this host, and meanwhile the daemon answers
nothing (the pass holds the interpreter lock). CPython starts one each time the objects that
survived younger collections have grown by a quarter, so a filling pool stalls again and
again, each stall longer than the last (``tools/bench_fill_pauses.py``, docs/benchmarks.md).

Index entries hold no reference cycles and are freed by reference counting when removed,
so a full pass over them never finds anything. After each full collection this moves the
survivors into the permanent generation (``gc.freeze``): the next full collection walks only
what arrived since, and its pause is that of the growth, not of the whole index. Before
freezing it collects the young generations, so fresh garbage cycles die instead of being
frozen.

What it gives up: a reference cycle among objects that were alive when frozen and died later
is not reclaimed until the next whole pass, every ``full_interval_s`` (0 = never), which
unfreezes everything and collects once (one pause of the old length, at a known rate). Such
cycles are rare in the daemon (per-connection state of clients that left); the index has none.

GC is process-wide state, so only the process that owns the daemon (``kvpool serve``)
creates one of these and hands it to ``PoolServer``; a server embedded in another program
(tests, an engine) leaves that program's collector alone.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvpool.gc")

#: how often the daemon looks for a full collection that ran since it last looked
TICK_MS = 1000
FULL_GENERATION = 2


class GcFreezer:
    """Freeze the survivors of each full collection; record how long full collections took.

    ``start`` installs it (one whole pass, then the first freeze), ``tick`` (every ``TICK_MS``
    from the daemon's supervisor) freezes after a full collection and runs the whole pass
    every ``full_interval_s``, ``close`` gives the collector back as it was."""

    def __init__(self, full_interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if full_interval_s < 0:
            raise ValueError(f"full_interval_s must be >= 0, not {full_interval_s}")
        self.full_interval_s = full_interval_s
        self._clock = clock
        self._lock = threading.Lock()  # tick (supervisor thread) against summary (a Stats call)
        self._seen_full = 0
        self._last_whole_pass = 0.0
        self._pause_started = 0.0
        self.full_collections = 0  # full collections since start (CPython's own and whole passes)
        self.freezes = 0
        self.whole_passes = 0
        self.last_full_pause_ms = 0.0
        self.max_full_pause_ms = 0.0

    def start(self) -> None:
        """A whole pass now (start-up's garbage dies), then freeze what is left: the modules,
        the daemon's own structures and the index the disk tier may have loaded. Called before
        the daemon serves; this first pass is not counted among the pauses."""
        self._whole_pass(self._clock())
        gc.callbacks.append(self._on_gc)
        log.info("gc: full collections walk only objects newer than the last one (--gc-freeze)")

    def close(self) -> None:
        """Stop timing collections and unfreeze (the next full collection walks everything)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        gc.unfreeze()

    def tick(self) -> None:
        """Freeze after a full collection CPython ran; the whole pass when it is due."""
        now = self._clock()
        with self._lock:
            if self.full_interval_s and now - self._last_whole_pass >= self.full_interval_s:
                self._whole_pass(now)
                return
            full = _full_collections()
            if full == self._seen_full:
                return
            gc.collect(FULL_GENERATION - 1)  # young garbage cycles die rather than being frozen
            gc.freeze()
            self.freezes += 1
            self._seen_full = _full_collections()

    def summary(self) -> dict[str, Any]:
        """For ``Stats`` and ``/metrics``."""
        with self._lock:
            return {
                "gc_frozen_objects": gc.get_freeze_count(),
                "gc_full_collections": self.full_collections,
                "gc_full_pause_ms_last": round(self.last_full_pause_ms, 3),
                "gc_full_pause_ms_max": round(self.max_full_pause_ms, 3),
            }

    def _whole_pass(self, now: float) -> None:
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self.whole_passes += 1
        self.freezes += 1
        self._last_whole_pass = now
        self._seen_full = _full_collections()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks``: time full collections (runs inside the collector: no locks, no GC)."""
        if info.get("generation") != FULL_GENERATION:
            return
        if phase == "start":
            self._pause_started = time.perf_counter()
            return
        pause_ms = (time.perf_counter() - self._pause_started) * 1000.0
        self.full_collections += 1
        self.last_full_pause_ms = pause_ms
        self.max_full_pause_ms = max(self.max_full_pause_ms, pause_ms)


def _full_collections() -> int:
    return int(gc.get_stats()[FULL_GENERATION]["collections"])
