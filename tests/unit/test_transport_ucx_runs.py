"""UCX reads move runs of blocks as one message: where the reader's rows lie end to end in
one array and the blocks lie end to end in the node's arena (a batch written together), the
server sends the run at once; every block in it is still verified on its own. Against a real
PoolNode arena and a real UCX data server, in-process."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.clock import MonotonicClock
from kvpool.core.config import DaemonConfig, StoreConfig
from kvpool.core.errors import InvalidArgument
from kvpool.core.hashing import HASH_SCHEME, block_hashes
from kvpool.core.keys import block_key
from kvpool.core.spec import KVSpec, Namespace
from kvpool.daemon.cluster_node import NodeBlockStore
from kvpool.daemon.node import PoolNode
from kvpool.transport import wire
from kvpool.transport.base import ReadItem
from kvpool.transport.factory import ucx_available
from kvpool.transport.runs import row_joins, run_bounds, server_runs, span

SPEC = KVSpec(model="tiny", num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)
NS = Namespace(SPEC, b"runs")
NS_DIGEST = NS.digest()
BB = SPEC.block_bytes
UCX = pytest.mark.skipif(bool(ucx_available()), reason=f"ucxx unusable: {ucx_available()}")


@pytest.fixture
def setup(tmp_path) -> Iterator[tuple[PoolNode, object]]:  # type: ignore[no-untyped-def]
    from kvpool.transport import ucx

    config = DaemonConfig(arena_dir=str(tmp_path), store=StoreConfig(capacity_bytes=4 << 20, slab_bytes=64 << 10))
    node = PoolNode(config, MonotonicClock())
    node.register(HASH_SCHEME, SPEC, NS_DIGEST, SPEC.digest())
    server = ucx.UcxDataServer(NodeBlockStore(node), "127.0.0.1:0")
    server.start()
    yield node, server
    server.stop()
    node.close()


def stored(node: PoolNode, server, transport, n: int, seed: int) -> tuple[list[bytes], np.ndarray]:  # type: ignore[no-untyped-def]
    """``n`` blocks written in one batch; their keys and bytes."""
    keys = block_hashes(NS, np.arange(16 * n))
    data = np.random.default_rng(seed).integers(0, 255, size=(n, BB), dtype=np.uint8)
    written = transport.write(server.address, NS_DIGEST, keys, data)
    assert written.stored + written.already_present == n
    return keys, data


def offsets(node: PoolNode, keys: list[bytes]) -> list[int]:
    return [node.store.entry(block_key(NS_DIGEST, k)).offset for k in keys]


@UCX
@pytest.mark.ucx
@pytest.mark.parametrize("direct", [True, False])
def test_a_batch_read_into_one_array_moves_as_few_messages_and_verifies(setup, direct: bool) -> None:  # type: ignore[no-untyped-def]
    from kvpool.transport import ucx

    node, server = setup
    transport = ucx.UcxTransport(timeout_s=3.0, direct=direct, streams=1)
    try:
        keys, data = stored(node, server, transport, 12, seed=1)
        at = offsets(node, keys)
        runs_in_arena = 1 + sum(at[i] != at[i - 1] + BB for i in range(1, len(at)))
        assert runs_in_arena < 12  # the batch sits (mostly) end to end in the arena
        out = np.zeros_like(data)
        result = transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in keys], list(out))
        assert result.ok == 12
        np.testing.assert_array_equal(out, data)
        assert transport.counters["messages"] == runs_in_arena
        # rows of separate arrays never join: one message per block
        apart = [np.zeros(BB, dtype=np.uint8) for _ in keys]
        assert transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in keys], apart).ok == 12
        np.testing.assert_array_equal(np.stack(apart), data)
        assert transport.counters["messages"] == runs_in_arena + (12 if direct else runs_in_arena)
    finally:
        transport.close()


@UCX
@pytest.mark.ucx
def test_a_rotten_block_inside_a_run_ends_the_read_there(setup) -> None:  # type: ignore[no-untyped-def]
    from kvpool.transport import ucx

    node, server = setup
    transport = ucx.UcxTransport(timeout_s=3.0, streams=1)
    try:
        keys, data = stored(node, server, transport, 8, seed=2)
        node.arena.view[offsets(node, keys)[5] + 17] ^= 0x41
        out = np.zeros_like(data)
        result = transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in keys], list(out))
        assert (result.ok, result.corrupt_index) == (5, 5)
        np.testing.assert_array_equal(out[:5], data[:5])
        # mended; the node holds only a prefix of the 10 asked for (8 and 9 were never
        # written): the runs cover what it serves, the rest stay untouched
        node.arena.view[offsets(node, keys)[5] + 17] ^= 0x41
        more = block_hashes(NS, np.arange(16 * 10))
        out10 = np.zeros((10, BB), dtype=np.uint8)
        result = transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in more], list(out10))
        assert (result.ok, result.corrupt_index) == (8, -1)
        np.testing.assert_array_equal(out10[:8], data)
        assert not out10[8:].any()
    finally:
        transport.close()


@UCX
@pytest.mark.ucx
def test_layer_ranges_and_a_reader_of_one_message_per_item_still_read(setup) -> None:  # type: ignore[no-untyped-def]
    from kvpool.transport import ucx

    node, server = setup

    per_item = ucx.UcxTransport(timeout_s=3.0, streams=1, runs=False)  # READ_UCX, as readers before runs
    for transport in (ucx.UcxTransport(timeout_s=3.0, streams=1), per_item):
        try:
            keys, data = stored(node, server, transport, 6, seed=3)
            offset, length = SPEC.layer_range_bytes(1, 2)
            parts = np.zeros((6, length), dtype=np.uint8)  # one array, but the ranges are apart in the arena
            items = [ReadItem(k, offset, length) for k in keys]
            assert transport.read(server.address, NS_DIGEST, items, list(parts)).ok == 6
            np.testing.assert_array_equal(parts, data[:, offset : offset + length])
            assert transport.counters["messages"] == 6
            out = np.zeros_like(data)
            assert transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in keys], list(out)).ok == 6
            np.testing.assert_array_equal(out, data)
        finally:
            transport.close()


def test_a_joins_bitmap_that_joins_item_zero_or_has_the_wrong_size_is_refused() -> None:
    assert wire.unpack_joins(wire.pack_joins([False, True, True, False, True]), 5) == [False, True, True, False, True]
    with pytest.raises(InvalidArgument):
        wire.unpack_joins(wire.pack_joins([True, False]), 2)
    with pytest.raises(InvalidArgument):
        wire.unpack_joins(b"\0\0", 3)


@settings(max_examples=200, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 4), min_size=1, max_size=12),
    apart=st.sets(st.integers(0, 11)),
    asked_off=st.sets(st.integers(0, 11)),
    data=st.binary(min_size=1, max_size=1),
)
def test_runs_cover_exactly_the_items_and_join_only_what_both_sides_allow(
    cuts: list[int], apart: set[int], asked_off: set[int], data: bytes
) -> None:
    """Blocks of sizes ``cuts`` laid out in an arena, a gap before the items in ``apart``; the
    server's runs, concatenated, are the items' bytes in order, and join only where asked and
    end to end."""
    rng = np.random.default_rng(len(cuts) + data[0])
    arena = rng.integers(0, 255, size=64, dtype=np.uint8)
    offsets, at = [], 0
    for i, size in enumerate(cuts):
        at += 1 if i in apart else 0
        offsets.append(at)
        at += size
    views = [arena[offset : offset + size] for offset, size in zip(offsets, cuts)]
    asked = [i > 0 and i not in asked_off for i in range(len(views))]
    joins, messages = server_runs(arena, offsets, cuts, asked)
    assert len(messages) == len(run_bounds(joins))
    assert b"".join(bytes(m) for m in messages) == b"".join(bytes(v) for v in views)
    for i, join in enumerate(joins):
        assert not join or (asked[i] and i not in apart)
        if i and asked[i] and i not in apart:
            assert join
    # the reader's side: rows of one array join, rows of separate arrays or strided ones do not
    rows = list(np.zeros((len(cuts), 8), dtype=np.uint8))
    assert row_joins(rows) == [i > 0 for i in range(len(rows))]
    target = span(rows)
    assert target.nbytes == 8 * len(rows) and target.ctypes.data == rows[0].ctypes.data
    assert row_joins([np.zeros(8, dtype=np.uint8) for _ in cuts]) == [False] * len(cuts)
    strided = list(np.zeros((len(cuts), 16), dtype=np.uint8)[:, ::2])
    assert row_joins(strided) == [False] * len(cuts)
    if len(rows) > 2:
        with pytest.raises(ValueError, match="end to end"):
            span(rows[::2])  # rows with gaps: never one span


@UCX
@pytest.mark.ucx
def test_a_node_before_runs_is_read_one_message_per_block(setup, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A node that does not offer READ_UCX_RUNS in its UCX_HELLO (flags 0) is read with
    READ_UCX; it would answer READ_UCX_RUNS as an unknown op."""
    from kvpool.transport import ucx

    node, _ = setup

    class NodeBeforeRuns(ucx.UcxDataServer):
        def _serve_other(self, conn, op, count, namespace, state):  # type: ignore[no-untyped-def]
            if op == wire.OP_READ_UCX_RUNS:
                return False  # "unknown op"
            if op != wire.OP_UCX_HELLO:
                return super()._serve_other(conn, op, count, namespace, state)
            link = ucx._Link(wire.recv_exact(conn, count), blocking=True)
            state["ucx"] = link
            conn.sendall(wire.pack_reply(wire.STATUS_OK, len(link.address)) + link.address)  # no flags
            return True

    old = NodeBeforeRuns(NodeBlockStore(node), "127.0.0.1:0")
    old.start()
    transport = ucx.UcxTransport(timeout_s=3.0, streams=1)
    try:
        keys, data = stored(node, old, transport, 6, seed=4)
        out = np.zeros_like(data)
        assert transport.read(old.address, NS_DIGEST, [ReadItem(k) for k in keys], list(out)).ok == 6
        np.testing.assert_array_equal(out, data)
        assert transport.counters["messages"] == 6
        (link,) = transport._links.values()
        assert not link.runs
    finally:
        transport.close()
        old.stop()


@UCX
@pytest.mark.ucx
def test_a_server_that_joins_rows_the_reader_did_not_offer_gets_a_miss_and_writes_nothing(setup) -> None:  # type: ignore[no-untyped-def]
    """Rows of one array with gaps between them ([0], [2], [4]) never join; a server that
    answers every item joined (which would make one receive span the rows in between, never
    handed over) is a protocol violation: a miss, before any receive is posted."""
    from kvpool.transport import ucx

    node, _ = setup

    class JoinsEverything(ucx.UcxDataServer):
        def _serve_read_ucx(self, conn, count, namespace, link, asked):  # type: ignore[no-untyped-def]
            leased = self._lease_for_read(conn, count, namespace)
            assert leased is not None
            lease_id, views, metas, _ = leased
            link.take_tag_base()
            try:
                joins = wire.pack_joins([i > 0 for i in range(len(views))])
                conn.sendall(wire.pack_reply(wire.STATUS_OK, len(views)) + b"".join(metas) + joins)
            finally:
                self._store.release(lease_id)

    hostile = JoinsEverything(NodeBlockStore(node), "127.0.0.1:0")
    hostile.start()
    transport = ucx.UcxTransport(timeout_s=3.0, streams=1)
    try:
        keys, _ = stored(node, hostile, transport, 3, seed=5)
        out = np.zeros((5, BB), dtype=np.uint8)
        result = transport.read(hostile.address, NS_DIGEST, [ReadItem(k) for k in keys], [out[0], out[2], out[4]])
        assert result.ok == 0 and "joins" in result.reason
        assert not out.any()
        assert transport.counters["messages"] == 0
    finally:
        transport.close()
        hostile.stop()


@UCX
@pytest.mark.ucx
def test_rows_that_stop_being_contiguous_past_what_the_node_holds_still_read(setup) -> None:  # type: ignore[no-untyped-def]
    """The reader decides direct or staged over every row it asked for, the same when it
    builds the request and when it receives: a strided row past the node's prefix makes the
    whole read staged, and the node's joins are then allowed."""
    from kvpool.transport import ucx

    node, server = setup
    transport = ucx.UcxTransport(timeout_s=3.0, streams=1)
    try:
        _, data = stored(node, server, transport, 4, seed=6)
        out = np.zeros((4, BB), dtype=np.uint8)
        strided = np.zeros((BB, 2), dtype=np.uint8)[:, 0]  # not C-contiguous
        more = block_hashes(NS, np.arange(16 * 5))  # the fifth is not on the node
        result = transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in more], [*out, strided])
        assert (result.ok, result.corrupt_index) == (4, -1)
        np.testing.assert_array_equal(out, data)
        assert transport.counters["staged_reads"] == 1
    finally:
        transport.close()


@UCX
@pytest.mark.ucx
def test_read_ucx_runs_before_ucx_hello_is_refused_and_the_connection_stays_in_step(setup) -> None:  # type: ignore[no-untyped-def]
    import socket

    _, server = setup
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=3.0) as sock:
        keys = block_hashes(NS, np.arange(16 * 2))
        request = wire.pack_header(wire.OP_READ_UCX_RUNS, 2, NS_DIGEST) + wire.pack_joins([False, True])
        sock.sendall(request + wire.pack_read_items([(k, 0, 0) for k in keys]))
        status, _, message = wire.recv_reply(sock, None)
        assert status == wire.STATUS_BAD_REQUEST and "UCX_HELLO" in message
        sock.sendall(wire.pack_header(wire.OP_PING, 0, NS_DIGEST))
        assert wire.recv_reply(sock, None)[0] == wire.STATUS_OK  # one reply each: still in step
