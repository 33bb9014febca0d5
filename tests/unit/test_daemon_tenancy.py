"""The node's tenancy pieces in isolation: block keys, per-namespace event numbering,
the bounded namespace table with retirement (fake clock), rate-limited logs and the
request decoder that turns any malformed message into a typed error."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import DaemonConfig, StoreConfig
from kvpool.core.errors import CapacityExhausted, InvalidArgument, UnknownNamespace
from kvpool.core.events import EventKind
from kvpool.core.hashing import HASH_SCHEME
from kvpool.core.keys import BlockKeys, block_key, block_keys, group_by_namespace, hashes_of, key_namespace
from kvpool.core.spec import KVSpec
from kvpool.daemon.event_log import EventLog
from kvpool.daemon.node import NAMESPACE_RETIRE_INTERVAL_MS, PoolNode
from kvpool.proto import pool_pb2
from kvpool.rpc.errors import RateLimitedLog
from kvpool.rpc.serving import decode_request

SPEC = KVSpec(model="tiny", num_layers=2, num_kv_heads=1, head_dim=16, dtype="float16", block_tokens=8)
A = b"a" * 16
B = b"b" * 16


def ns(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_block_keys_join_and_split_namespace_and_hash() -> None:
    hashes = [bytes([i]) * 16 for i in range(3)]
    keys = block_keys(A, hashes)
    assert keys[0] == A + hashes[0] == block_key(A, hashes[0]) and key_namespace(keys[1]) == A
    assert hashes_of(keys) == hashes
    assert group_by_namespace([*keys, *block_keys(B, hashes[:1])]) == {A: hashes, B: hashes[:1]}
    with pytest.raises(InvalidArgument):
        block_keys(b"short", hashes)


def test_lazy_block_keys_are_the_same_keys() -> None:
    hashes = [bytes([i]) * 16 for i in range(5)]
    lazy = BlockKeys(A, b"".join(hashes))
    assert len(lazy) == 5 and list(lazy) == block_keys(A, hashes)
    assert lazy[1] == lazy[-4] == A + hashes[1] and lazy[3:] == block_keys(A, hashes[3:])
    with pytest.raises(IndexError):
        lazy[5]
    with pytest.raises(InvalidArgument) as info:
        BlockKeys(A, b"\x01" * 17)
    assert "multiple of 16" in info.value.message


def test_release_many_ends_known_leases_and_counts_the_rest(tmp_path: Path) -> None:
    node = make_node(tmp_path, FakeClock())
    try:
        put_one(node, A)
        grant = node.store.lease([block_key(A, b"h" * 16)])
        assert node.store.release_many([grant.lease_id, 12345, grant.lease_id]) == 2
        assert node.store.summary()["leases_active"] == 0
    finally:
        node.close()


def test_scoped_reads_see_only_their_namespace_numbered_in_it() -> None:
    log = EventLog("n")
    for i in range(6):
        log.append(EventKind.STORED, [bytes([i]) * 16], A if i % 2 else B)
    a_events = log.read_from(1, 0, namespace=A)
    assert [(e.seq, e.hashes[0][0]) for e in a_events] == [(1, 1), (2, 3), (3, 5)]
    assert all(e.namespace == A for e in a_events)
    assert [e.seq for e in log.read_from(3, 0, namespace=A)] == [3]
    assert log.read_from(4, 0, namespace=A) == []
    assert log.last_seq_of(A) == 3 and log.last_seq_of(b"c" * 16) == 0
    assert [e.seq for e in log.read_from(1, 0)] == list(range(1, 7))  # the node-wide view


def test_a_scoped_reader_past_the_kept_log_sees_a_gap_and_counters_are_bounded() -> None:
    log = EventLog("n", capacity_events=2, max_namespaces_tracked=2)
    for i in range(4):
        log.append(EventKind.STORED, [bytes([i]) * 16], A)
    assert [e.seq for e in log.read_from(1, 0, namespace=A)] == [3, 4]  # 1 and 2 are gone: a gap
    log.append(EventKind.STORED, [b"x" * 16], B)
    log.append(EventKind.STORED, [b"y" * 16], b"c" * 16)
    assert log.last_seq_of(A) == 0  # dropped (least recently written); B and c are kept
    assert log.last_seq_of(B) == 1


def make_node(tmp_path: Path, clock: FakeClock, max_namespaces: int = 4) -> PoolNode:
    store = StoreConfig(capacity_bytes=1 << 20, slab_bytes=64 << 10)
    config = DaemonConfig(arena_dir=str(tmp_path), store=store, max_namespaces=max_namespaces, namespace_idle_ms=1000)
    return PoolNode(config, clock)


def put_one(node: PoolNode, namespace: bytes) -> None:
    data = np.ones(SPEC.block_bytes, np.uint8)
    grant = node.store.put_start(namespace, [block_key(namespace, b"h" * 16)], SPEC.block_bytes)
    offset = grant.slots[0][1]
    node.arena.view[offset : offset + SPEC.block_bytes] = data
    assert node.store.put_commit(grant.put_id, [checksum64(data)]).committed == 1


def test_a_full_table_retires_blockless_namespaces_least_recently_used_first(tmp_path: Path) -> None:
    clock = FakeClock()
    node = make_node(tmp_path, clock)
    try:
        for i in range(4):
            node.register(HASH_SCHEME, SPEC, ns(i), SPEC.digest())
            clock.advance(1)
        put_one(node, ns(0))  # holds a block: never retired
        node.namespace(ns(1))  # used lately
        node.register(HASH_SCHEME, SPEC, ns(9), SPEC.digest())  # the table was full
        names = {info.digest for info in node.namespaces()}
        assert ns(0) in names and ns(9) in names and ns(2) not in names
        assert node.namespaces_retired >= 1
        with pytest.raises(UnknownNamespace):
            node.namespace(ns(2))
    finally:
        node.close()


def test_a_table_full_of_namespaces_with_blocks_refuses_new_ones(tmp_path: Path) -> None:
    node = make_node(tmp_path, FakeClock(), max_namespaces=2)
    try:
        for i in range(2):
            node.register(HASH_SCHEME, SPEC, ns(i), SPEC.digest())
            put_one(node, ns(i))
        with pytest.raises(CapacityExhausted):
            node.register(HASH_SCHEME, SPEC, ns(5), SPEC.digest())
    finally:
        node.close()


def test_the_sweeper_retires_idle_blockless_namespaces_only(tmp_path: Path) -> None:
    clock = FakeClock()
    node = make_node(tmp_path, clock)
    try:
        for i in range(3):
            node.register(HASH_SCHEME, SPEC, ns(i), SPEC.digest())
        put_one(node, ns(0))
        clock.advance(NAMESPACE_RETIRE_INTERVAL_MS)
        node.namespace(ns(2))  # active: not idle for namespace_idle_ms
        node.sweep()
        assert {info.digest for info in node.namespaces()} == {ns(0), ns(2)}
    finally:
        node.close()


def test_rate_limited_log_holds_repeats_and_counts_them(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("kvpool.test"), 10.0, now=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvpool.test"):
        assert [limited.emit("Hello", "bad") for _ in range(5)] == [True, False, False, False, False]
        now[0] = 11.0
        assert limited.emit("Hello", "bad again") and limited.emit("Lookup", "other kind")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["bad", "bad again (4 more like it in the last 10 s not logged)", "other kind"]


@pytest.mark.parametrize(
    "raw",
    [b"\xff", b"\x0a\x05abc", b"\x12\x02\xc3\x28"],  # bad tag, truncated field, a string not UTF-8
)
def test_undecodable_requests_are_invalid_argument(raw: bytes) -> None:
    with pytest.raises(InvalidArgument) as info:
        decode_request(raw, pool_pb2.HelloRequest, "Hello", 1 << 20)
    assert "Hello" in info.value.message


def test_oversized_requests_are_refused_before_decoding() -> None:
    with pytest.raises(InvalidArgument) as info:
        decode_request(b"\x00" * 2048, pool_pb2.HelloRequest, "Hello", 1024)
    assert "2048" in info.value.message and "1024" in info.value.message


def test_the_directory_forgets_namespaces_no_block_names_when_its_table_is_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import json

    from kvpool.directory import state as directory_state
    from kvpool.directory.state import DirectoryState, NodeRecord

    monkeypatch.setattr(directory_state, "MAX_NAMESPACES", 2)
    s = DirectoryState(FakeClock())
    row = [json.dumps(SPEC.to_dict())]

    def register(node: str, namespaces: list[bytes], keys: list[bytes]) -> None:
        record = NodeRecord(node, f"{node}:1", f"{node}:2", "tcp", node)
        s.register(record, HASH_SCHEME, [(n, SPEC.digest(), row[0]) for n in namespaces], keys, b"")

    register("a", [ns(1), ns(2)], [block_key(ns(1), b"h" * 16)])
    register("b", [ns(3)], [])  # full: ns(2) has no block, it is forgotten
    assert s.summary()["namespaces"] == 2
    register("c", [ns(4)], [block_key(ns(4), b"h" * 16)])  # ns(3) has no block: forgotten
    with pytest.raises(CapacityExhausted):
        register("d", [ns(5)], [])  # ns(1) and ns(4) both have blocks
    assert s.summary()["namespaces"] == 2
