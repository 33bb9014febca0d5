"""When a tier evicts ahead of need, and how much at a time: its high and low watermarks.

A write that would take a tier above its high watermark starts a drain. From then on each
write evicts, in the tier's policy order, its own room plus at most as much again
(``EVICT_AHEAD``) until usage is down to the low watermark; writes then evict nothing until
the next crossing. A full tier evicts as many bytes as it writes either way; what this
decides is when: spread over the writes of a drain (each pays at most twice its own size
toward the low watermark), never (high - low) of the tier in one write. A write also frees
whatever it must to stay under the high watermark (usage above it after the tier shrank, or
after a drain found only blocks that could not go): that part is not bounded.

Why not the burst (the write that crossed high evicted all the way down to low, until
2026-12-05): that one write evicted a tenth of the tier (at the default 0.95 / 0.85) with the
tier's lock held, ~2 us a block: 0.2-0.35 s at a million 4 KiB host blocks, with every
lookup and put of the node waiting (``tools/bench_fill_pauses.py``,
``tools/bench_evict_drain.py``, docs/benchmarks.md); a disk tier of more blocks longer (not
measured).

1.0 / 1.0 is evict-on-demand: a write that would not fit evicts exactly its own room. Each
tier holds one ``WatermarkDrain`` and calls it under the tier's lock.
"""

from __future__ import annotations

from collections.abc import Callable

#: a write during a drain evicts its own room plus at most this many times as much again
EVICT_AHEAD = 1


class WatermarkDrain:
    """One tier's drain state: whether writes are evicting toward the low watermark."""

    def __init__(self, high: float, low: float) -> None:
        self.high = high
        self.low = low
        self.draining = False

    def floor(self, used_bytes: int, need_bytes: int, capacity_bytes: float) -> float | None:
        """The usage a write of ``need_bytes`` evicts down to before it writes; None:
        nothing now (a write that then finds no free slot still evicts on demand)."""
        if used_bytes + need_bytes > self.high * capacity_bytes:
            self.draining = True
        if not self.draining:
            return None
        target = self.low * capacity_bytes - need_bytes  # with this write, usage at low
        if used_bytes <= target:
            self.draining = False
            return None
        share = max(target, used_bytes - (1 + EVICT_AHEAD) * need_bytes)
        # and never above high with this write (>= target: low <= high)
        floor = min(share, self.high * capacity_bytes - need_bytes)
        if floor <= target:
            self.draining = False  # this write finishes the drain
        return floor

    def evict(
        self, floor: float | None, used_bytes: Callable[[], int], evict_one: Callable[[], bool], limit: int = 0
    ) -> bool:
        """Evict with ``evict_one`` (the tier's policy victim; False when nothing may go) while
        ``used_bytes()`` is above ``floor`` (from ``floor``; None: nothing); when nothing more
        can go the drain stops (``stuck``). True when done; False when ``limit`` evictions
        (0: no limit) ran first and the caller should come back for the rest."""
        evicted = 0
        while floor is not None and used_bytes() > floor:
            if limit and evicted >= limit:
                return False
            if not evict_one():
                self.stuck()
                break
            evicted += 1
        return True

    def stuck(self) -> None:
        """Nothing more could be evicted (leased, pinned, being read or written): stop the
        drain. A write that would still cross high starts it again (and searches again); one
        below high evicts nothing until the next crossing."""
        self.draining = False
