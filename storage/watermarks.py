"""When a tier evicts ahead of need, and how much at a time: its high and low watermarks.

A write that would take a tier above its high watermark starts a drain. From then on each
write evicts, in the tier's policy order, its own room plus at most as much again
(``EVICT_AHEAD``) until usage is down to the low watermark; writes then evict nothing until
the next crossing. Over a cycle the tier evicts (high - low) of its capacity, as one burst
did, but no write pays for more than twice what it writes.

Why not the burst (the write that crossed high evicted all the way down to low, until
2026-12-05): that one write evicted a tenth of the tier (at the default 0.95 / 0.85) with the
tier's lock held, ~2.5 us a block: 0.27-0.35 s at a million 4 KiB host blocks, with every
lookup and put of the node waiting (``tools/bench_fill_pauses.py``, docs/benchmarks.md), and
seconds for a disk tier of millions of blocks.

1.0 / 1.0 is evict-on-demand: a write that would not fit evicts exactly its own room. Each
tier holds one ``WatermarkDrain`` and calls it under the tier's lock.
"""

from __future__ import annotations

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
        floor = max(target, used_bytes - (1 + EVICT_AHEAD) * need_bytes)
        if floor == target:
            self.draining = False  # this write finishes the drain
        return floor

    def stuck(self) -> None:
        """Nothing more could be evicted (leased, pinned, being read or written): stop until
        the next crossing, or every write would search for a victim in vain."""
        self.draining = False
