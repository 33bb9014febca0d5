"""``kvpool.daemon.gc_pauses.GcFreezer`` in this process: the survivors of a full collection
are frozen (later full collections skip them), young garbage cycles are collected rather than
frozen, the whole pass every ``full_interval_s`` reclaims a cycle that died while frozen (and
is tried again when another collection kept it from running), full pauses are timed, and
``close`` gives the collector back."""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Iterator

import pytest

from kvpool.daemon import gc_pauses
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
        # counted at the freeze; a frozen object that dies since (a thread of an earlier test
        # in this process finishing) leaves the permanent generation, so the count only shrinks
        counted = freezer.summary()["gc_frozen_objects"]
        assert 0 < frozen <= counted and counted - frozen <= counted // 100
        kept = [Node() for _ in range(1000)]  # alive, newer than the freeze
        freezer.tick()  # no full collection ran since: nothing more is frozen
        assert gc.get_freeze_count() <= frozen and freezer.freezes == 1
        gc.collect()  # a full collection (CPython runs these on its own)
        summary = freezer.summary()
        assert summary["gc_full_collections"] >= 1
        assert 0.0 < summary["gc_full_pause_seconds_max"] < 60.0
        assert summary["gc_full_pause_seconds_last"] <= summary["gc_full_pause_seconds_max"]
        clock.now += gc_pauses.COUNT_EVERY_S  # the frozen objects are counted at most this often
        freezer.tick()
        assert gc.get_freeze_count() >= frozen + len(kept)
        assert freezer.freezes == 2 and freezer.summary()["gc_frozen_objects"] >= frozen + len(kept)
        assert freezer.summary()["gc_whole_passes"] == 0  # the start's pass is not one
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
        summary = freezer.summary()
        assert summary["gc_whole_passes"] == 1 and summary["gc_whole_pass_seconds_last"] > 0
        assert freezer.last_whole_pass_collected >= 1
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


def test_a_whole_pass_kept_from_running_is_not_counted_and_is_tried_again(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    freezer = GcFreezer(60, clock)
    freezer.start()
    try:
        node = Node()
        dead = weakref.ref(node)
        freezer.tick()
        gc.freeze()  # as a freeze would: node is frozen alive
        del node
        clock.now += 60
        with monkeypatch.context() as patch:
            # gc.collect while another thread's collection is in progress: returns 0, collects nothing
            patch.setattr(gc_pauses.gc, "collect", lambda generation=2: 0)
            freezer.tick()
        assert freezer.whole_passes == 0 and dead() is not None
        freezer.tick()  # still due: this time it runs
        assert freezer.whole_passes == 1 and dead() is None
    finally:
        freezer.close()


def test_a_stop_without_its_start_is_not_a_pause(clock: Clock) -> None:
    freezer = GcFreezer(60, clock)
    freezer._on_gc("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
    assert freezer.full_collections == 0 and freezer.max_full_pause_s == 0.0


def test_risky_intervals_are_logged(clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    for interval, words in ((0, "grows without bound"), (5, "pauses the daemon that often")):
        freezer = GcFreezer(interval, clock)
        with caplog.at_level(logging.WARNING, logger="kvpool.gc"):
            freezer.start()
        freezer.close()
        assert words in caplog.text
        caplog.clear()


def test_young_collections_that_moved_survivors_up_are_frozen_without_a_full_one(clock: Clock) -> None:
    """Once FREEZE_AFTER_YOUNG generation-1 collections have run since the last freeze, their
    survivors are frozen too: the next full collection has at most those to walk."""
    freezer = GcFreezer(3600, clock)
    freezer.start()
    try:
        kept = [Node() for _ in range(1000)]
        for _ in range(gc_pauses.FREEZE_AFTER_YOUNG - 1):
            gc.collect(1)
        full = gc.get_stats()[2]["collections"]
        frozen = gc.get_freeze_count()
        freezer.tick()
        assert freezer.freezes == 1  # not yet: one young collection short
        gc.collect(1)
        freezer.tick()
        assert gc.get_freeze_count() >= frozen + len(kept)
        assert gc.get_stats()[2]["collections"] == full  # no full collection was needed for it
    finally:
        freezer.close()


def test_the_frozen_count_catches_up_within_a_minute_of_a_freeze_without_another(clock: Clock) -> None:
    freezer = GcFreezer(3600, clock)
    freezer.start()
    try:
        counted = freezer.summary()["gc_frozen_objects"]
        kept = [Node() for _ in range(1000)]
        gc.collect()
        clock.now += 1
        freezer.tick()  # frozen now, but counted at most once a minute
        assert freezer.freezes == 2 and freezer.summary()["gc_frozen_objects"] == counted
        clock.now += gc_pauses.COUNT_EVERY_S
        freezer.tick()  # nothing new to freeze: the count is still taken
        assert freezer.summary()["gc_frozen_objects"] >= counted + len(kept)
    finally:
        freezer.close()
