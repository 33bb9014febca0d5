"""DirectoryState: registration with snapshots, ordered events with gap detection,
whole-prompt lookup, placement, leases, node expiry and the RocksDB restart path."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.clock import FakeClock
from kvpool.core.errors import NotFound, SpecMismatch, VersionMismatch
from kvpool.core.hashing import HASH_SCHEME, block_hashes
from kvpool.core.spec import KVSpec, Namespace
from kvpool.directory.state import DirectoryDB, DirectoryState, EventIn, NodeRecord

SPEC = KVSpec(model="tiny", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=4)
NS = Namespace(SPEC, b"t")
NS_ROW = (NS.digest(), SPEC.digest(), json.dumps(SPEC.to_dict()))
KEYS = block_hashes(NS, list(range(4 * 64)))


def node(name: str, incarnation: int = 1, used: int = 0, capacity: int = 1 << 30) -> NodeRecord:
    return NodeRecord(name, f"{name}:1", f"{name}:2", "tcp", "h-" + name, capacity, used, incarnation)


def state(clock: FakeClock | None = None, ttl_ms: int = 1000, db: DirectoryDB | None = None) -> DirectoryState:
    return DirectoryState(clock or FakeClock(), node_ttl_ms=ttl_ms, db=db)


def test_lookup_returns_holders_per_block_and_stops_at_first_gap() -> None:
    s = state()
    s.register(node("a"), HASH_SCHEME, [NS_ROW], KEYS[:10], b"")
    s.register(node("b"), HASH_SCHEME, [NS_ROW], KEYS[5:12], b"")
    result = s.lookup(KEYS[:20])
    assert result.hits == 12
    names = [n.node_id for n in result.nodes]
    holders = [{names[b] for b in range(len(names)) if m >> b & 1} for m in result.masks]
    assert holders[0] == {"a"} and holders[7] == {"a", "b"} and holders[11] == {"b"}


def test_lookup_counters_count_hits_per_best_tier_and_keep_read_locates_apart() -> None:
    s = state()
    s.register(node("a"), HASH_SCHEME, [NS_ROW], KEYS[:6], bytes([0, 0, 1, 1, 2, 1]))  # host, disk, device
    s.register(node("b"), HASH_SCHEME, [NS_ROW], KEYS[3:4], bytes([0]))  # block 3 also in b's host
    assert s.lookup(KEYS[:10]).hits == 6
    assert s.lookup(KEYS[:10], for_read=True).hits == 6  # the read after the lookup: not a lookup
    summary = s.summary()
    assert (summary["lookups"], summary["lookup_blocks"], summary["lookup_hits"]) == (1, 10, 6)
    assert summary["read_locates"] == 1
    # block 3's best holder is b's host; the directory's order is host, disk, device
    assert summary["lookup_hit_blocks_by_tier"] == {"host": 3, "disk": 2, "device": 1}


def test_events_apply_in_order_and_a_gap_asks_for_resync() -> None:
    s = state()
    s.register(node("a"), HASH_SCHEME, [NS_ROW], [], b"")
    assert s.heartbeat("a", 1, 0, 1 << 30, [EventIn(1, "stored", KEYS[:3])]) == (False, 1)
    assert s.heartbeat("a", 1, 0, 1 << 30, [EventIn(1, "stored", KEYS[:3])]) == (False, 1)  # retried: idempotent
    assert s.heartbeat("a", 1, 0, 1 << 30, [EventIn(2, "removed", KEYS[1:2])]) == (False, 2)
    assert s.lookup(KEYS[:3]).hits == 1
    resync, acked = s.heartbeat("a", 1, 0, 1 << 30, [EventIn(5, "stored", KEYS[3:4])])
    assert resync and acked == 2
    assert s.heartbeat("a", 2, 0, 1 << 30, []) == (True, 0)  # new incarnation must register again
    assert s.heartbeat("zz", 1, 0, 1 << 30, []) == (True, 0)  # unknown node


def test_cleared_event_drops_everything_of_the_node() -> None:
    s = state()
    s.register(node("a"), HASH_SCHEME, [NS_ROW], KEYS[:5], b"")
    s.heartbeat("a", 1, 0, 1, [EventIn(1, "cleared", [])])
    assert s.lookup(KEYS[:5]).hits == 0


def test_reregistration_replaces_the_nodes_blocks() -> None:
    s = state()
    s.register(node("a"), HASH_SCHEME, [NS_ROW], KEYS[:5], b"")
    s.register(node("a", incarnation=2), HASH_SCHEME, [NS_ROW], KEYS[10:12], b"")
    assert s.lookup(KEYS[:5]).hits == 0
    assert s.lookup(KEYS[10:12]).hits == 2


def test_wrong_scheme_or_spec_is_refused_with_a_clear_message() -> None:
    s = state()
    with pytest.raises(VersionMismatch, match="scheme"):
        s.register(node("a"), "other-h9", [NS_ROW], [], b"")
    other = KVSpec(model="tiny", num_layers=3, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=4)
    with pytest.raises(SpecMismatch, match="does not match"):
        s.register(node("a"), HASH_SCHEME, [(NS.digest(), SPEC.digest(), json.dumps(other.to_dict()))], [], b"")
    s.register(node("a"), HASH_SCHEME, [NS_ROW], [], b"")
    with pytest.raises(SpecMismatch, match="same model"):
        s.register(node("b"), HASH_SCHEME, [(NS.digest(), other.digest(), json.dumps(other.to_dict()))], [], b"")


def test_silent_node_expires_and_its_blocks_are_no_longer_offered() -> None:
    clock = FakeClock()
    s = state(clock, ttl_ms=1000)
    s.register(node("a"), HASH_SCHEME, [NS_ROW], KEYS[:4], b"")
    s.register(node("b"), HASH_SCHEME, [NS_ROW], KEYS[:2], b"")
    clock.advance(600)
    s.heartbeat("b", 1, 0, 1 << 30, [])
    clock.advance(600)
    assert s.expire() == ["a"]
    assert s.lookup(KEYS[:4]).hits == 2
    assert [n.node_id for n in s.lookup(KEYS[:2]).nodes] == ["b"]


def test_placement_is_local_first_then_most_free() -> None:
    s = state()
    s.register(node("a", used=900, capacity=1000), HASH_SCHEME, [], [], b"")
    s.register(node("b", used=100, capacity=1000), HASH_SCHEME, [], [], b"")
    s.register(node("c", used=500, capacity=1000), HASH_SCHEME, [], [], b"")
    assert [n.node_id for n in s.place(1, 10, client_node="c")] == ["c"]
    assert [n.node_id for n in s.place(1, 10, client_node="a", replicas=2)] == ["a", "b"]
    assert [n.node_id for n in s.place(1, 200, client_node="a")] == ["b"]  # a has no room for 200 bytes
    assert [n.node_id for n in s.place(1, 10, replicas=3)] == ["b", "c", "a"]
    empty = state()
    with pytest.raises(NotFound):
        empty.place(1, 10)


def test_remove_of_leased_blocks_waits_for_the_lease() -> None:
    clock = FakeClock()
    s = state(clock)
    s.register(node("a"), HASH_SCHEME, [NS_ROW], KEYS[:4], b"")
    lease = s.lookup(KEYS[:2], lease_ms=500).lease_id
    assert lease
    groups, deferred = s.remove(KEYS[:4], NS.digest())
    assert groups == {"a": KEYS[2:4]} and deferred == 2
    assert s.take_due_removes() == {}
    clock.advance(600)
    s.expire()
    assert s.take_due_removes() == {NS.digest(): {"a": KEYS[:2]}}


def test_restart_from_rocksdb_answers_at_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    clock = FakeClock()
    db = DirectoryDB(str(tmp_path / "dir"))
    s = state(clock, db=db)
    s.register(node("a"), HASH_SCHEME, [NS_ROW], KEYS[:6], b"")
    s.heartbeat("a", 1, 0, 1 << 30, [EventIn(1, "removed", KEYS[5:6])])
    s.flush()
    db.close()
    db2 = DirectoryDB(str(tmp_path / "dir"))
    s2 = state(clock, ttl_ms=1000, db=db2)
    assert s2.epoch == 2
    assert s2.lookup(KEYS[:6]).hits == 5
    # the node continues its event stream without a resync (same incarnation, next seq)
    assert s2.heartbeat("a", 1, 0, 1 << 30, [EventIn(2, "stored", KEYS[5:6])]) == (False, 2)
    assert s2.lookup(KEYS[:6]).hits == 6
    # a node that never comes back is dropped after the TTL
    s2.register(node("b"), HASH_SCHEME, [NS_ROW], [], b"")
    clock.advance(1500)
    s2.heartbeat("b", 1, 0, 1 << 30, [])
    assert "a" in s2.expire()
    assert s2.lookup(KEYS[:1]).hits == 0
    db2.close()


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.booleans(), st.integers(0, 15)), max_size=60))
def test_lookup_matches_a_model_of_who_holds_what(ops: list[tuple[str, bool, int]]) -> None:
    """After any sequence of stored/removed events, a lookup's per-block holders are exactly
    the nodes whose applied events leave them holding the block."""
    s = state()
    held: dict[str, set[int]] = {n: set() for n in "abc"}
    seq = dict.fromkeys("abc", 0)
    for name in "abc":
        s.register(node(name), HASH_SCHEME, [NS_ROW], [], b"")
    for name, store, i in ops:
        seq[name] += 1
        s.heartbeat(name, 1, 0, 1 << 30, [EventIn(seq[name], "stored" if store else "removed", [KEYS[i]])])
        (held[name].add if store else held[name].discard)(i)
    result = s.lookup(KEYS[:16])
    expected_hits = next((i for i in range(16) if not any(i in h for h in held.values())), 16)
    assert result.hits == expected_hits
    names = [n.node_id for n in result.nodes]
    for i, mask in enumerate(result.masks):
        assert {names[b] for b in range(len(names)) if mask >> b & 1} == {n for n in "abc" if i in held[n]}
