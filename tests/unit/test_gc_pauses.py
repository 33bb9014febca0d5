"""``kvpool.daemon.gc_pauses.GcFreezer`` in this process: the survivors of a full collection
are frozen (later full collections skip them), young garbage cycles are collected rather than
frozen, the whole pass every ``full_interval_s`` reclaims a cycle that died while frozen, full
pauses are timed, and ``close`` gives the collector back."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from kvpool.daemon.gc_pauses import GcFreezer


class Node:
    """A reference cycle (``self.me = self``): only the collector can free it."""

    def __init__(self) -> None:
        self.me = self


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Iterator[Clock]:
    yield Clock()
    gc.unfreeze()  # whatever a test left frozen goes back to the collector


def test_start_freezes_what_is_alive_and_a_later_full_collection_is_frozen_too(clock: Clock) -> None:
    freezer = GcFreezer(3600, clock)
    freezer.start()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        kept = [Node() for _ in range(1000)]  # alive, newer than the freeze
        freezer.tick()  # no full collection ran since: nothing more is frozen
        assert gc.get_freeze_count() <= frozen
        gc.collect()  # a full collection (CPython runs these on its own)
        assert freezer.summary()["gc_full_collections"] >= 1
        freezer.tick()
        assert gc.get_freeze_count() >= frozen + len(kept)
        assert freezer.summary()["gc_full_pause_ms_max"] >= 0.0
    finally:
        freezer.close()
    assert gc.get_freeze_count() == 0
    assert freezer._on_gc not in gc.callbacks


def test_young_garbage_cycles_are_collected_not_frozen(clock: Clock) -> None:
    freezer = GcFreezer(3600, clock)
    freezer.start()
    try:
        gc.collect()
        garbage = Node()
        dead = weakref.ref(garbage)
        del garbage  # a cycle nobody holds, still in the young generation
        freezer.tick()  # freezes after the full collection above
        assert dead() is None
    finally:
        freezer.close()


def test_a_cycle_that_died_while_frozen_is_reclaimed_by_the_whole_pass(clock: Clock) -> None:
    freezer = GcFreezer(60, clock)
    node = Node()
    dead = weakref.ref(node)
    freezer.start()  # node is alive: frozen
    try:
        del node
        gc.collect()  # a full collection does not walk frozen objects
        freezer.tick()
        assert dead() is not None
        clock.now += 60
        freezer.tick()  # the whole pass is due
        assert dead() is None
        assert gc.get_freeze_count() > 0  # and what lives is frozen again
    finally:
        freezer.close()


def test_never_a_whole_pass_with_interval_zero(clock: Clock) -> None:
    freezer = GcFreezer(0, clock)
    node = Node()
    dead = weakref.ref(node)
    freezer.start()
    try:
        del node
        clock.now += 10**9
        freezer.tick()
        assert dead() is not None
    finally:
        freezer.close()
    gc.collect()
    assert dead() is None  # unfrozen by close: the collector gets it


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="full_interval_s"):
        GcFreezer(-1)
