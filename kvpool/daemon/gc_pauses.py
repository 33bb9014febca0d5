"""Keep the block index out of the garbage collector's full passes (``--gc-freeze``).

CPython's full (generation 2) collection walks every object it tracks, and the store's
index holds one per block (``storage.host_types.Entry``) plus its eviction order: with a
million blocks a full pass takes ~0.2 s on this host, and meanwhile the daemon answers
nothing (the pass holds the interpreter lock). CPython starts one each time the objects that
survived younger collections have grown by a quarter, so a filling pool stalls again and
again, each stall longer than the last (``tools/bench_fill_pauses.py``, docs/benchmarks.md).

Index entries hold no reference cycles and are freed by reference counting when removed,
so a full pass over them never finds anything. After each full collection, and whenever ten
young (generation 1) collections have moved survivors into the old generation since the last
freeze (looked at every second), this moves them into the permanent generation
(``gc.freeze``): a full collection then walks only what arrived since the last freeze (about
a second of the pool's growth at most), not the whole index. Before freezing it collects the
young generations, so fresh garbage cycles die instead of being frozen.

What it gives up: a reference cycle among objects that were alive when frozen and died later
is not reclaimed until the next whole pass, every ``full_interval_s``, which unfreezes
everything and collects once (one pause of the old length, at a known rate, logged). Such
cycles are rare in the daemon (per-connection state of clients that left); the index has
none. With ``full_interval_s`` 0 they are never reclaimed: memory held by them then grows
without bound, slowly.

GC is process-wide state, so only the process that owns the daemon (``kvpool serve``)
creates one of these and hands it to ``PoolServer``; a server embedded in another program
leaves that program's collector alone. ``close`` and the whole pass unfreeze the whole
process, also what its program froze itself. Written for CPython 3.11's generational
collector (3.12 and 3.13 have the same); a warning is logged on a later version.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvpool.gc")

#: how often the daemon looks for a full collection that ran since it last looked
TICK_MS = 1000
FULL_GENERATION = 2
#: freeze after this many generation-1 collections since the last freeze (each moves the
#: survivors of up to ~7,000 allocations into the old generation, at CPython 3.11's thresholds)
FREEZE_AFTER_YOUNG = 10
#: how often the frozen objects are counted (for Stats), at most
COUNT_EVERY_S = 60.0
#: below this a whole pass comes often enough to be a stall operators would notice
SHORT_INTERVAL_S = 60


class GcFreezer:
    """Freeze the survivors of each full collection and of every ten young ones; time
    CPython's full collections.

    ``start`` installs it (one whole pass, then the first freeze), ``tick`` (every ``TICK_MS``
    from the daemon's supervisor) freezes after a full collection and runs the whole pass
    every ``full_interval_s``, ``close`` gives the collector back as it was."""

    def __init__(self, full_interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if full_interval_s < 0:
            raise ValueError(f"full_interval_s must be >= 0, not {full_interval_s}")
        self.full_interval_s = full_interval_s
        self._clock = clock
        # tick (supervisor thread) against summary (a Stats call); never held across a
        # collection, so a finalizer that reads the summary cannot deadlock
        self._lock = threading.Lock()
        self._seen_full = 0
        self._young_at_freeze = 0
        self._counted_at = float("-inf")
        self._count_due = False
        self._last_whole_pass = 0.0
        self._pause_started: float | None = None
        self._in_whole_pass = False
        self.frozen_objects = 0  # as last counted (_count_frozen: at most once a minute after a freeze)
        self.full_collections = 0  # CPython's own full collections since start
        self.last_full_pause_s = 0.0
        self.max_full_pause_s = 0.0
        self.freezes = 0
        self.whole_passes = 0
        self.last_whole_pass_s = 0.0
        self.last_whole_pass_collected = 0

    def start(self) -> None:
        """A whole pass now (start-up's garbage dies), then freeze what is left: the modules,
        the daemon's own structures and the index the disk tier may have loaded. Called before
        the daemon serves; this first pass is not counted as a pause."""
        if sys.version_info >= (3, 14):
            log.warning("gc: --gc-freeze was written for CPython 3.11-3.13's collector; this is %s", sys.version)
        if self.full_interval_s == 0:
            log.warning(
                "gc: --gc-full-interval-s 0: reference cycles among frozen objects are never reclaimed "
                "(memory they hold grows without bound)"
            )
        elif self.full_interval_s < SHORT_INTERVAL_S:
            log.warning(
                "gc: a whole collection every %s s pauses the daemon that often, as long as one without "
                "--gc-freeze (~0.2 s a million blocks)",
                self.full_interval_s,
            )
        self._whole_pass(self._clock(), first=True)
        gc.callbacks.append(self._on_gc)
        log.info(
            "gc: full collections walk only objects newer than the last one (--gc-freeze); whole pass every %s",
            f"{self.full_interval_s} s" if self.full_interval_s else "never",
        )

    def close(self) -> None:
        """Stop timing collections and unfreeze (the next full collection walks everything)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        gc.unfreeze()

    def tick(self) -> None:
        """Freeze after a full collection CPython ran, or once ``FREEZE_AFTER_YOUNG``
        generation-1 collections have moved survivors into the old generation since the last
        freeze (so the next full collection has at most those to walk); the whole pass when it
        is due. A collection another thread has in progress makes ``gc.collect`` return at
        once without collecting: then nothing is frozen or counted, and the next tick tries
        again."""
        now = self._clock()
        if self.full_interval_s and now - self._last_whole_pass >= self.full_interval_s:
            self._whole_pass(now)
            return
        full, young = _collections(FULL_GENERATION), _collections(FULL_GENERATION - 1)
        if full == self._seen_full and young - self._young_at_freeze < FREEZE_AFTER_YOUNG:
            self._count_frozen(now)
            return
        gc.collect(FULL_GENERATION - 1)  # young garbage cycles die rather than being frozen
        if _collections(FULL_GENERATION - 1) == young:
            return  # another thread is collecting: try again next tick
        gc.freeze()
        with self._lock:
            self.freezes += 1
            self._count_due = True
            self._seen_full = _collections(FULL_GENERATION)
            self._young_at_freeze = _collections(FULL_GENERATION - 1)
        self._count_frozen(now)

    def _count_frozen(self, now: float) -> None:
        """Count the frozen objects for Stats after a freeze, at most once a ``COUNT_EVERY_S``:
        counting walks every one of them (~10 ms a million, the interpreter lock held)."""
        if not self._count_due or now - self._counted_at < COUNT_EVERY_S:
            return
        frozen = gc.get_freeze_count()
        with self._lock:
            self.frozen_objects, self._counted_at, self._count_due = frozen, now, False

    def summary(self) -> dict[str, Any]:
        """For ``Stats`` and ``/metrics`` (cheap: nothing here walks the heap)."""
        with self._lock:
            return {
                "gc_frozen_objects": self.frozen_objects,
                "gc_full_collections": self.full_collections,
                "gc_full_pause_seconds_last": round(self.last_full_pause_s, 6),
                "gc_full_pause_seconds_max": round(self.max_full_pause_s, 6),
                "gc_whole_passes": self.whole_passes,
                "gc_whole_pass_seconds_last": round(self.last_whole_pass_s, 6),
            }

    def _whole_pass(self, now: float, first: bool = False) -> None:
        """Unfreeze, collect everything, freeze again. If another thread's collection is in
        progress nothing was collected: not counted, and the next tick tries again."""
        before = _collections(FULL_GENERATION)
        started = time.perf_counter()
        self._in_whole_pass = True
        try:
            gc.unfreeze()
            collected = gc.collect()
            gc.freeze()
        finally:
            self._in_whole_pass = False
        took_s = time.perf_counter() - started
        ran = _collections(FULL_GENERATION) != before
        frozen = gc.get_freeze_count()
        with self._lock:
            self.frozen_objects, self._counted_at = frozen, now
            self._seen_full = _collections(FULL_GENERATION)
            self._young_at_freeze = _collections(FULL_GENERATION - 1)
            if not ran:
                return
            self.freezes += 1
            self._last_whole_pass = now
            if first:
                return
            self.whole_passes += 1
            self.last_whole_pass_s = took_s
            self.last_whole_pass_collected = collected
        log.info(
            "gc: whole pass over %d objects took %.3f s and reclaimed %d (cycles that died while frozen)",
            frozen,
            took_s,
            collected,
        )

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks``: time CPython's own full collections (runs inside the collector:
        no locks). A "stop" without its "start" (installed mid-collection) is ignored."""
        if info.get("generation") != FULL_GENERATION or self._in_whole_pass:
            return
        if phase == "start":
            self._pause_started = time.perf_counter()
            return
        started, self._pause_started = self._pause_started, None
        if started is None:
            return
        pause_s = time.perf_counter() - started
        self.full_collections += 1
        self.last_full_pause_s = pause_s
        self.max_full_pause_s = max(self.max_full_pause_s, pause_s)


def _collections(generation: int) -> int:
    return int(gc.get_stats()[generation]["collections"])
