"""Review findings on DirectoryState (kvpool/directory/state.py), now regression tests, plus
the tests of their fixes (capped lookup replies, RocksDB flushes that die, ClusterClient._plan)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpool.directory.index as index_module
from kvpool.core.clock import FakeClock
from kvpool.core.hashing import HASH_SCHEME, block_hashes
from kvpool.core.spec import KVSpec, Namespace
from kvpool.directory.state import (
    MAX_HOLDERS_IN_REPLY,
    TIER_CODES,
    TIER_RANK,
    DirectoryDB,
    DirectoryState,
    EventIn,
    NodeRecord,
)

SPEC = KVSpec(model="tiny", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=4)
NS = Namespace(SPEC, b"review")
NS_ROW = (NS.digest(), SPEC.digest(), json.dumps(SPEC.to_dict()))
KEYS = block_hashes(NS, list(range(4 * 16)))


def node(name: str) -> NodeRecord:
    return NodeRecord(name, f"{name}:1", f"{name}:2", "tcp", "h-" + name, 1 << 30, 0, 1)


def hot_first_block() -> DirectoryState:
    """KEYS[0] held by MAX_HOLDERS_IN_REPLY nodes (a hot, replicated system prompt), KEYS[:2]
    by one more node, 'late': a lookup of KEYS[:2] has more holders than a reply may name."""
    s = DirectoryState(FakeClock(), node_ttl_ms=1000)
    for i in range(MAX_HOLDERS_IN_REPLY):
        s.register(node(f"n{i:03d}"), HASH_SCHEME, [NS_ROW], KEYS[:1], b"")
    s.register(node("late"), HASH_SCHEME, [NS_ROW], KEYS[:2], b"")
    return s


def test_every_hit_names_at_least_one_holder() -> None:
    s = hot_first_block()
    result = s.lookup(KEYS[:2])
    assert len(result.nodes) <= MAX_HOLDERS_IN_REPLY
    for i in range(result.hits):
        assert result.masks[i] != 0, f"block {i} reported as a hit with no holder in the reply"


# -- capped lookup replies -----------------------------------------------------------------


def test_a_capped_reply_keeps_the_holder_that_reaches_furthest() -> None:
    s = hot_first_block()
    result = s.lookup(KEYS[:2])
    # 'late' holds both blocks: naming it makes the second block a hit too
    assert result.hits == 2
    assert len(result.nodes) == MAX_HOLDERS_IN_REPLY
    late_bit = [n.node_id for n in result.nodes].index("late")
    assert result.masks[1] == 1 << late_bit
    assert result.masks[0] == (1 << MAX_HOLDERS_IN_REPLY) - 1  # the rest of the room: replicas


def test_a_capped_reply_stops_at_the_first_block_it_cannot_cover() -> None:
    s = DirectoryState(FakeClock(), node_ttl_ms=1000)
    # block i is held by node i alone: only the first MAX_HOLDERS_IN_REPLY blocks fit
    hashes = block_hashes(NS, list(range(4 * (MAX_HOLDERS_IN_REPLY + 2))))
    for i, key in enumerate(hashes):
        s.register(node(f"n{i:03d}"), HASH_SCHEME, [NS_ROW], [key], b"")
    result = s.lookup(hashes, lease_ms=1000)
    assert result.hits == MAX_HOLDERS_IN_REPLY
    assert len(result.masks) == len(result.tiers) == MAX_HOLDERS_IN_REPLY
    assert [n.node_id for n in result.nodes] == [f"n{i:03d}" for i in range(MAX_HOLDERS_IN_REPLY)]
    # the lease covers the hits only: a remove of the first uncovered block is not deferred
    assert s.remove(hashes[MAX_HOLDERS_IN_REPLY : MAX_HOLDERS_IN_REPLY + 1])[1] == 0


def _brute_force_hits(intervals: list[tuple[int, int]], blocks: int, cap: int) -> int:
    """The longest prefix of ``blocks`` that at most ``cap`` of the nodes cover."""
    best = 0
    for k in range(0, min(cap, len(intervals)) + 1):
        for combo in itertools.combinations(intervals, k):
            covered = 0
            while covered < blocks and any(a <= covered < b for a, b in combo):
                covered += 1
            best = max(best, covered)
    return best


@settings(max_examples=60, deadline=None)
@given(
    cap=st.integers(1, 3),
    blocks=st.integers(1, 6),
    spans=st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 6), st.sampled_from(["host", "disk", "device"])),
        min_size=1,
        max_size=7,
    ),
)
def test_capped_replies_cover_every_hit_and_as_long_a_prefix_as_possible(
    cap: int, blocks: int, spans: list[tuple[int, int, str]]
) -> None:
    """Nodes holding contiguous runs of the prompt (what chain hashes give): the reply never
    names more than the cap, every hit has a real holder in the reply, its tier is the best of
    those holders, and the hit run is the longest any choice of ``cap`` nodes could cover."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(index_module, "MAX_HOLDERS_IN_REPLY", cap)
        check_capped_reply(cap, blocks, spans)


def check_capped_reply(cap: int, blocks: int, spans: list[tuple[int, int, str]]) -> None:
    hashes = KEYS[:blocks]
    s = DirectoryState(FakeClock(), node_ttl_ms=1000)
    intervals: list[tuple[int, int]] = []
    held: dict[str, dict[bytes, str]] = {}
    for i, (start, length, tier) in enumerate(spans):
        a, b = min(start, blocks), min(start + length, blocks)
        name = f"n{i}"
        s.register(node(name), HASH_SCHEME, [NS_ROW], hashes[a:b], bytes([TIER_CODES[tier]]) * (b - a))
        intervals.append((a, b))
        held[name] = {key: tier for key in hashes[a:b]}
    result = s.lookup(hashes)
    assert len(result.nodes) <= cap
    assert result.hits == _brute_force_hits(intervals, blocks, cap)
    for i in range(result.hits):
        named = [n.node_id for bit, n in enumerate(result.nodes) if result.masks[i] >> bit & 1]
        assert named, f"block {i} is a hit with no holder"
        assert all(hashes[i] in held[name] for name in named)
        best = min((TIER_CODES[held[name][hashes[i]]] for name in named), key=lambda t: TIER_RANK[t])
        assert result.tiers[i] == best


# -- RocksDB flushes ------------------------------------------------------------------------


class _CrashOnWrite:
    """Wraps the Rdict: the process dies in the middle of a flush, at the write of a node's
    batch (its row and its key list)."""

    class Crash(Exception):
        pass

    def __init__(self, db: object) -> None:
        self._db = db

    def write(self, batch: object) -> None:
        raise self.Crash("write")

    def __getattr__(self, name: str) -> object:
        return getattr(self._db, name)


def test_a_flush_that_dies_leaves_the_last_whole_node_rows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A node's row (its seq) and its key list go in one write batch: a crash leaves both as
    the last flush wrote them, so the restarted directory asks for the events it missed (a
    resync) instead of continuing the stream over a stale key list."""
    clock = FakeClock()
    db = DirectoryDB(str(tmp_path / "dir"))
    s = DirectoryState(clock, node_ttl_ms=1000, db=db)
    s.register(node("a"), HASH_SCHEME, [NS_ROW], KEYS[:6], b"")
    s.flush()
    assert s.heartbeat("a", 1, 0, 1 << 30, [EventIn(1, "removed", KEYS[5:6])]) == (False, 1)
    real = db._db
    db._db = _CrashOnWrite(real)
    with pytest.raises(_CrashOnWrite.Crash):
        s.flush()  # the directory process dies here
    db._db = real
    db.close()

    s2 = DirectoryState(clock, node_ttl_ms=1000, db=DirectoryDB(str(tmp_path / "dir")))
    assert s2.node("a") is not None and s2.node("a").last_seq == 0  # type: ignore[union-attr]
    assert s2.lookup(KEYS[:6]).hits == 6  # the key list of seq 0, with it
    resync, _ = s2.heartbeat("a", 1, 0, 1 << 30, [EventIn(2, "stored", KEYS[6:7])])
    assert resync  # seq 2 does not follow seq 0


def test_a_key_list_of_an_older_format_is_a_resync_not_a_stale_answer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    clock = FakeClock()
    db = DirectoryDB(str(tmp_path / "dir"))
    s = DirectoryState(clock, node_ttl_ms=1000, db=db)
    s.register(node("a"), HASH_SCHEME, [NS_ROW], KEYS[:6], b"")
    s.flush()
    db._db[b"keys/a"] = b"KVK2" + bytes(16) + bytes([32]) + KEYS[0] + bytes(1)  # two puts, paired by stamps
    db.close()
    s2 = DirectoryState(clock, node_ttl_ms=1000, db=DirectoryDB(str(tmp_path / "dir")))
    assert s2.lookup(KEYS[:6]).hits == 0
    assert s2.heartbeat("a", 1, 0, 1 << 30, [EventIn(1, "stored", KEYS[6:7])])[0]


def test_a_failed_flush_is_retried_by_the_next_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    clock = FakeClock()
    db = DirectoryDB(str(tmp_path / "dir"))
    s = DirectoryState(clock, node_ttl_ms=1000, db=db)
    s.register(node("a"), HASH_SCHEME, [NS_ROW], KEYS[:4], b"")
    real = db._db
    db._db = _CrashOnWrite(real)
    with pytest.raises(_CrashOnWrite.Crash):
        s.flush()
    db._db = real
    assert s.flush() == 1  # the node is still dirty
    db.close()
    s2 = DirectoryState(clock, node_ttl_ms=1000, db=DirectoryDB(str(tmp_path / "dir")))
    assert s2.lookup(KEYS[:4]).hits == 4
    assert s2.heartbeat("a", 1, 0, 1 << 30, []) == (False, 0)


def test_key_lists_from_before_the_key_length_mean_a_resync(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from rocksdict import Rdict

    path = str(tmp_path / "dir")
    raw = Rdict(path)  # the layout older versions wrote: no stamp in either row
    raw[b"node/a"] = json.dumps(node("a").public()).encode()
    raw[b"keys/a"] = b"".join(KEYS[:2]) + bytes(2)
    raw.close()
    s = DirectoryState(FakeClock(), node_ttl_ms=1000, db=DirectoryDB(path))
    assert s.lookup(KEYS[:2]).hits == 0
    assert s.heartbeat("a", 1, 0, 1 << 30, [EventIn(1, "stored", KEYS[2:3])])[0] is True


# -- ClusterClient._plan -------------------------------------------------------------------


def test_plan_treats_a_block_without_holders_as_the_end_of_the_hits() -> None:
    from kvpool.client.cluster_client import ClusterClient, Holder

    client = ClusterClient.__new__(ClusterClient)  # _plan needs only what _rank reads
    client.local = None
    client.same_host_shm = False
    client.host = "here"
    x = Holder("x", "x:1", "x:2", "there")
    y = Holder("y", "y:1", "y:2", "there")
    assert client._plan([[x], [x, y], [], [y]]) == [(x, 0, 2)]
    assert client._plan([[], [x]]) == []
