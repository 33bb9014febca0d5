"""Properties of the location index and LRU caches, against brute force."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.scheduler.index import LocationIndex, LruCache, TieredCache, make_cache
from kvpool.storage.eviction import POLICIES

H = [bytes([i]) * 16 for i in range(12)]

ops = st.lists(
    st.tuples(st.sampled_from(["add", "remove", "clear"]), st.integers(0, 11), st.integers(0, 3)), max_size=80
)


@settings(max_examples=150, deadline=None)
@given(ops, st.lists(st.integers(0, 11), max_size=10))
def test_prefix_lengths_match_brute_force(operations: list[tuple[str, int, int]], query: list[int]) -> None:
    idx = LocationIndex(4)
    truth: list[set[bytes]] = [set() for _ in range(4)]
    for op, h, m in operations:
        if op == "add":
            idx.add(H[h], m)
            truth[m].add(H[h])
        elif op == "remove":
            idx.remove(H[h], m)
            truth[m].discard(H[h])
        else:
            idx.clear_member(m)
            truth[m].clear()
    hashes = [H[i] for i in query]
    lens, union = idx.prefix_lengths(hashes)
    for m in range(4):
        k = 0
        while k < len(hashes) and hashes[k] in truth[m]:
            k += 1
        assert lens[m] == k
    u = 0
    while u < len(hashes) and any(hashes[u] in t for t in truth):
        u += 1
    assert union == u
    assert len(idx) == len(set().union(*truth))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.frozensets(st.integers(0, 69), max_size=70)), max_size=12),
    st.lists(st.integers(0, 5), max_size=8),
)
def test_prefix_lengths_with_many_members(holders: list[tuple[int, frozenset[int]]], query: list[int]) -> None:
    """70 members: whole groups of instances drop out at once (the vectorised bit path)."""
    idx = LocationIndex(70)
    truth: list[set[bytes]] = [set() for _ in range(70)]
    for h, members in holders:
        for m in members:
            idx.add(H[h], m)
            truth[m].add(H[h])
    hashes = [H[i] for i in query]
    lens, _ = idx.prefix_lengths(hashes)
    for m in range(70):
        k = 0
        while k < len(hashes) and hashes[k] in truth[m]:
            k += 1
        assert lens[m] == k


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 5), st.lists(st.tuples(st.booleans(), st.integers(0, 11)), max_size=60))
def test_lru_matches_a_reference_model(cap: int, operations: list[tuple[bool, int]]) -> None:
    left: list[bytes] = []
    lru = LruCache(cap, on_leave=left.append)
    ref: OrderedDict[bytes, None] = OrderedDict()
    for insert, h in operations:
        key = H[h]
        if insert:
            if key in ref:
                ref.move_to_end(key)
            else:
                ref[key] = None
                if len(ref) > cap:
                    ref.popitem(last=False)
            lru.insert(key)
        else:
            if key in ref:
                ref.move_to_end(key)
            lru.touch(key)
        assert lru.keys() == list(ref) and len(lru) <= cap


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(0, 4), st.lists(st.integers(0, 11), max_size=60))
def test_tiered_cache_holds_at_most_both_capacities_and_reports_every_departure(
    hbm: int, dram: int, inserts: list[int]
) -> None:
    held: set[bytes] = set()
    cache = TieredCache(hbm, dram, on_leave=held.discard)
    for h in inserts:
        cache.insert(H[h])
        held.add(H[h])
        assert len(cache.hbm) <= hbm and len(cache.dram) <= dram
        assert {k for k in H if k in cache} == held  # the index sees exactly what the tiers hold
        assert H[h] in cache.hbm  # the newest block is in HBM


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(sorted(POLICIES)),
    st.integers(0, 5),
    st.integers(0, 3),
    st.lists(st.tuples(st.booleans(), st.integers(0, 11)), max_size=60),
)
def test_every_eviction_policy_keeps_capacity_and_reports_departures(
    policy: str, hbm: int, dram: int, operations: list[tuple[bool, int]]
) -> None:
    held: set[bytes] = set()
    pool = make_cache(dram, policy, on_leave=held.discard)
    tiered = TieredCache(hbm, dram, on_leave=lambda h: None, eviction=policy)
    for insert, h in operations:
        if insert:
            held.add(H[h])  # before: a zero-capacity cache reports the departure at once
            pool.insert(H[h])
            tiered.insert(H[h])
        else:
            pool.touch(H[h])
        assert len(pool) <= dram and {k for k in H if k in pool} == held
        assert len(tiered.hbm) <= hbm and len(tiered.dram) <= dram
