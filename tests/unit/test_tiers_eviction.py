"""S3-FIFO: scan resistance, protected keys, registry."""

from __future__ import annotations

import pytest

from kvpool.storage.eviction import POLICIES, ARCPolicy, LRUPolicy, S3FIFOPolicy, make_policy


def k(i: int) -> bytes:
    return i.to_bytes(4, "little")


def run_cache(policy_name: str, capacity: int, trace: list[int]) -> set[bytes]:
    policy = make_policy(policy_name)
    resident: set[bytes] = set()
    for i in trace:
        key = k(i)
        if key in resident:
            policy.on_access(key)
            continue
        while len(resident) >= capacity:
            victim = policy.pop_victim(lambda _k: True)
            assert victim is not None
            resident.remove(victim)
        resident.add(key)
        policy.on_insert(key)
    return resident


@pytest.mark.parametrize("name", ["s3fifo", "arc"])
def test_scan_resistant_policies_keep_a_hot_set_through_a_scan_that_flushes_lru(name: str) -> None:
    hot = list(range(10))
    trace = hot * 3 + list(range(1000, 1200)) + hot  # hot set, one-hit scan, hot again
    kept = run_cache(name, 50, trace[: -len(hot)])
    lru = run_cache("lru", 50, trace[: -len(hot)])
    assert {k(i) for i in hot} <= kept  # the hot set survived the scan
    assert not {k(i) for i in hot} & lru  # LRU's did not
    # LRU lost the hot set during the scan: it had to re-insert all of it (as misses)
    policy = LRUPolicy()
    resident: set[bytes] = set()
    misses_after_scan = 0
    for n, i in enumerate(trace):
        key = k(i)
        if key in resident:
            policy.on_access(key)
            continue
        if n >= len(trace) - len(hot):
            misses_after_scan += 1
        while len(resident) >= 50:
            victim = policy.pop_victim(lambda _k: True)
            assert victim is not None
            resident.remove(victim)
        resident.add(key)
        policy.on_insert(key)
    assert misses_after_scan == len(hot)


def test_s3fifo_never_returns_a_protected_key_and_reports_none_when_all_are() -> None:
    p = S3FIFOPolicy()
    for i in range(20):
        p.on_insert(k(i))
    for i in range(0, 20, 2):
        p.on_access(k(i))
    protected = {k(i) for i in range(15)}
    victims = []
    while (v := p.pop_victim(lambda key: key not in protected)) is not None:
        victims.append(v)
    assert set(victims) == {k(i) for i in range(15, 20)}
    assert p.pop_victim(lambda key: key not in protected) is None
    assert len(p) == 15


def test_s3fifo_ghost_hit_goes_straight_to_main() -> None:
    p = S3FIFOPolicy()
    for i in range(10):
        p.on_insert(k(i))
    assert p.pop_victim(lambda _k: True) == k(0)  # one-hit: evicted from small, remembered
    p.on_insert(k(0))  # comes back: ghost hit -> main queue
    assert k(0) in p._main and k(0) not in p._small


def test_s3fifo_on_remove_forgets_the_key() -> None:
    p = S3FIFOPolicy()
    p.on_insert(k(1))
    p.on_insert(k(2))
    p.on_remove(k(1))
    assert len(p) == 1
    assert p.pop_victim(lambda _k: True) == k(2)
    assert p.pop_victim(lambda _k: True) is None


def test_arc_ghost_hits_move_the_target_toward_the_list_that_missed() -> None:
    p = ARCPolicy()
    for i in range(4):
        p.on_insert(k(i))
    assert p.pop_victim(lambda _k: True) == k(0)  # T1's LRU goes to ghost B1
    assert p._p == 0.0
    p.on_insert(k(0))  # a B1 ghost hit: recency was cut too short, T1's target grows
    assert p._p >= 1.0 and k(0) in p._t2
    p.on_access(k(1))  # a T1 hit promotes to T2
    assert k(1) in p._t2 and k(1) not in p._t1
    assert len(p) == 4


def test_registry_has_lru_s3fifo_and_arc() -> None:
    assert {"lru", "s3fifo", "arc"} <= set(POLICIES)
    assert make_policy("s3fifo").name == "s3fifo" and make_policy("arc").name == "arc"
    with pytest.raises(Exception, match="unknown eviction policy"):
        make_policy("nope")
