"""Eviction policies, pluggable per tier.

A policy only orders keys; the store decides what may go (leases, pins, in-flight
writes) and passes that as the ``evictable`` predicate, so no policy can ever pick a
leased or hard-pinned block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from kvpool.core.errors import InvalidArgument


class EvictionPolicy(Protocol):
    name: str

    def on_insert(self, key: bytes) -> None:
        """A block became visible in the tier."""
        ...

    def on_access(self, key: bytes) -> None:
        """A block was hit."""
        ...

    def on_remove(self, key: bytes) -> None:
        """A block left the tier for a reason other than ``pop_victim``."""
        ...

    def pop_victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        """Choose, forget and return one evictable key; None if none is."""
        ...

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def on_insert(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def pop_victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        for key in self._order:
            if evictable(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    factory = POLICIES.get(name)
    if factory is None:
        raise InvalidArgument(f"unknown eviction policy {name!r}", hint=f"use one of {sorted(POLICIES)}")
    return factory()


class S3FIFOPolicy:
    """S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost
    FIFO of keys recently evicted from the small one.

    Why: KV prefix traffic mixes hot shared prefixes (system prompts, earlier turns) with
    long one-hit tails of fresh prompts. LRU lets a burst of one-hit blocks flush the hot
    set; S3-FIFO sends new blocks through the small queue first, so a block must be hit
    again before the main queue gives it room (scan resistance). Sizes are counted in
    blocks against the current population, because the store, not the policy, knows
    capacity: the small queue targets ``small_fraction`` of the resident blocks and the
    ghost remembers as many keys as are resident.
    """

    name = "s3fifo"
    MAX_FREQ = 3

    def __init__(self, small_fraction: float = 0.1) -> None:
        if not 0.0 < small_fraction < 1.0:
            raise ValueError("small_fraction must be in (0, 1)")
        self.small_fraction = small_fraction
        self._small: OrderedDict[bytes, None] = OrderedDict()
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}

    def on_insert(self, key: bytes) -> None:
        if key in self._freq:
            self.on_access(key)
            return
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._freq[key] = 0

    def on_access(self, key: bytes) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < self.MAX_FREQ:
            self._freq[key] = freq + 1

    def on_remove(self, key: bytes) -> None:
        if self._freq.pop(key, None) is None:
            return
        self._small.pop(key, None)
        self._main.pop(key, None)

    def pop_victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        # Every step either evicts, moves a key small -> main (at most once per key), lowers a
        # frequency (at most MAX_FREQ per key) or skips a protected key (counted per queue
        # pass), so the loop ends; a pass in which no queue yields anything returns None.
        small_skips = 0
        main_skips = 0
        while self._small or self._main:
            total = len(self._small) + len(self._main)
            small_turn = bool(self._small) and (
                len(self._small) >= max(1.0, self.small_fraction * total) or not self._main
            )
            if small_turn and small_skips >= len(self._small):
                small_turn = False
            if not small_turn and main_skips >= len(self._main):
                if self._small and small_skips < len(self._small):
                    small_turn = True
                else:
                    return None
            if small_turn:
                key = next(iter(self._small))
                if not evictable(key):
                    self._small.move_to_end(key)
                    small_skips += 1
                    continue
                del self._small[key]
                if self._freq[key] >= 1:
                    self._freq[key] = 0
                    self._main[key] = None
                    continue
                del self._freq[key]
                self._ghost[key] = None
                while len(self._ghost) > max(1, len(self._small) + len(self._main)):
                    self._ghost.popitem(last=False)
                return key
            key = next(iter(self._main))
            if not evictable(key):
                self._main.move_to_end(key)
                main_skips += 1
                continue
            freq = self._freq[key]
            if freq > 0:
                self._freq[key] = freq - 1
                self._main.move_to_end(key)
                continue
            del self._main[key]
            del self._freq[key]
            return key
        return None

    def __len__(self) -> int:
        return len(self._freq)


POLICIES["s3fifo"] = S3FIFOPolicy


class ARCPolicy:
    """ARC (Megiddo & Modha, FAST'03): recency list T1 and frequency list T2, each with a
    ghost list (B1, B2) of recently evicted keys; a hit in a ghost list moves the target
    size ``p`` of T1 toward whichever list would have kept the block.

    Why: it adapts between recency (LRU-like) and frequency without a tuning knob, so it
    resists scans like S3-FIFO while tracking LRU where recency is what matters. The cache
    size ``c`` is taken as the number of resident blocks (the store, not the policy, knows
    bytes), which equals the capacity in blocks once the tier is full.
    """

    name = "arc"

    def __init__(self) -> None:
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._p = 0.0

    def on_insert(self, key: bytes) -> None:
        if key in self._t1 or key in self._t2:
            self.on_access(key)
            return
        c = max(1, len(self._t1) + len(self._t2))
        if key in self._b1:
            self._p = min(float(c), self._p + max(len(self._b2) / max(1, len(self._b1)), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / max(1, len(self._b2)), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def on_access(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def pop_victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        prefer_t1 = bool(self._t1) and (len(self._t1) > self._p or not self._t2)
        order = ((self._t1, self._b1), (self._t2, self._b2))
        for resident, ghost in order if prefer_t1 else order[::-1]:
            for key in resident:
                if evictable(key):
                    del resident[key]
                    ghost[key] = None
                    self._trim_ghosts()
                    return key
        return None

    def _trim_ghosts(self) -> None:
        c = max(1, len(self._t1) + len(self._t2))
        while len(self._b1) + len(self._b2) > c:
            (self._b1 if len(self._b1) > len(self._b2) else self._b2).popitem(last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


POLICIES["arc"] = ARCPolicy
