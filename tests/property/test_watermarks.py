"""``storage.watermarks.WatermarkDrain``, the one rule of the three tiers' watermarks, over
any sequence of writes (hypothesis): usage never passes the high watermark, no write evicts
more than twice its own size beyond what it needs to fit, a drain started by a crossing ends
at the low watermark, and 1.0 / 1.0 evicts exactly a write's room when it would not fit."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.storage.watermarks import EVICT_AHEAD, WatermarkDrain

CAPACITY = 10_000


def write(drain: WatermarkDrain, used: float, need: int) -> tuple[float, float]:
    """(usage after, bytes evicted) of one write, every block evictable: a tier evicts
    whole blocks (here bytes) while usage is above the floor."""
    floor = drain.floor(int(used), need, CAPACITY)
    after = max(0.0, min(used, math.floor(floor))) if floor is not None else used
    after = min(after, CAPACITY - need)  # on demand: a write that does not fit evicts its room
    return after + need, used - after


watermarks = st.tuples(st.floats(0.05, 1.0), st.floats(0.05, 1.0)).map(lambda t: (max(t), min(t)))


@settings(max_examples=300, deadline=None)
@given(watermarks, st.lists(st.integers(1, CAPACITY // 2), min_size=1, max_size=400))
def test_usage_stays_under_high_and_no_write_evicts_more_than_its_share(
    marks: tuple[float, float], needs: list[int]
) -> None:
    high, low = marks
    drain, used = WatermarkDrain(high, low), 0.0
    for need in needs:
        before = used
        used, evicted = write(drain, used, need)
        assert used <= max(high * CAPACITY, need) + 1e-6  # a write larger than high cannot be under it
        # what the write had to free to stay under high, in whole units (blocks here: bytes)
        fit = math.ceil(max(0.0, before + need - high * CAPACITY) - 1e-9)
        assert evicted <= max(fit, (1 + EVICT_AHEAD) * need) + 1e-6


@settings(max_examples=200, deadline=None)
@given(watermarks, st.lists(st.integers(1, CAPACITY // 50), min_size=1, max_size=3))
def test_a_drain_ends_at_the_low_watermark_then_nothing_until_high(
    marks: tuple[float, float], sizes: list[int]
) -> None:
    high, low = marks
    drain, used, drains_ended = WatermarkDrain(high, low), 0.0, 0
    for i in range(4 * CAPACITY // min(sizes)):
        need = sizes[i % len(sizes)]
        was_draining, before = drain.draining, used
        used, evicted = write(drain, used, need)
        if not was_draining and before + need <= high * CAPACITY:
            assert evicted == 0  # below high and not draining: nothing goes
        if evicted and not drain.draining:  # this write ended a drain: usage is at low
            drains_ended += 1
            assert used <= low * CAPACITY + 1e-6
    if (high, low) != (1.0, 1.0):
        assert drains_ended >= 1  # writes of four capacities crossed high and drained


@given(st.integers(0, CAPACITY), st.integers(1, CAPACITY))
def test_one_one_is_evict_on_demand(used: int, need: int) -> None:
    floor = WatermarkDrain(1.0, 1.0).floor(used, need, CAPACITY)
    if used + need <= CAPACITY:
        assert floor is None
    else:
        assert floor == CAPACITY - need
