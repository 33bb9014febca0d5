"""UCX reads that time out: bytes the peer sends after the deadline must never land in the
caller's rows (already reported as a miss, and perhaps recomputed by the engine since). A
direct read (the default without RDMA) retires its link: never progressed again, so nothing
more lands; a staged read's late bytes land in its staging buffer instead. A refused UCX read
keeps the connection in step."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvpool.core.clock import MonotonicClock
from kvpool.core.config import DaemonConfig, StoreConfig
from kvpool.core.hashing import HASH_SCHEME, block_hashes
from kvpool.core.keys import block_keys
from kvpool.core.spec import KVSpec, Namespace
from kvpool.daemon.cluster_node import NodeBlockStore
from kvpool.daemon.node import PoolNode
from kvpool.transport.base import ReadItem
from kvpool.transport.factory import ucx_available

pytestmark = [pytest.mark.ucx, pytest.mark.skipif(bool(ucx_available()), reason=f"ucxx unusable: {ucx_available()}")]

SPEC = KVSpec(model="tiny", num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)
NS = Namespace(SPEC, b"late")
NS_DIGEST = NS.digest()
BB = SPEC.block_bytes
SEND_DELAY_S = 1.0


@pytest.fixture
def node(tmp_path) -> Iterator[PoolNode]:  # type: ignore[no-untyped-def]
    config = DaemonConfig(arena_dir=str(tmp_path), store=StoreConfig(capacity_bytes=4 << 20, slab_bytes=64 << 10))
    pool_node = PoolNode(config, MonotonicClock())
    pool_node.register(HASH_SCHEME, SPEC, NS_DIGEST, SPEC.digest())
    yield pool_node
    pool_node.close()


def late_server(store: NodeBlockStore) -> object:
    """A UCX data server that answers the reply header at once (the reader posts its
    receives) and sends the bytes only ``SEND_DELAY_S`` later, past the reader's deadline."""
    from ucxx._lib.arr import Array  # type: ignore[import-untyped]

    from kvpool.transport import ucx, wire

    class LateServer(ucx.UcxDataServer):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.sent = threading.Event()  # set once the late sends were attempted

        def _serve_read_ucx(
            self, conn: socket.socket, count: int, namespace: bytes, link: ucx._Link, asked: list[bool] | None
        ) -> None:
            leased = self._lease_for_read(conn, count, namespace)
            assert leased is not None
            lease_id, views, metas, _ = leased
            base = link.take_tag_base()
            try:
                joins = b"" if asked is None else wire.pack_joins([False] * len(views))  # a message per item
                conn.sendall(wire.pack_reply(wire.STATUS_OK, len(views)) + b"".join(metas) + joins)
                time.sleep(SEND_DELAY_S)
                requests = [
                    link.endpoint.tag_send(Array(view), tag=ucx.ucx_api.UCXXTag(base | i))
                    for i, view in enumerate(views)
                ]
                link.wait(requests, time.monotonic() + 3.0)
            finally:
                self._store.release(lease_id)
                self.sent.set()

    return LateServer(store, "127.0.0.1:0")


def timed_out_read(server: Any, transport: Any, first_block: int, seed: int) -> np.ndarray:
    """Write two blocks to the late server, read them back past the deadline (a miss); the
    caller's rows that read was given."""
    keys = block_hashes(NS, np.arange(16 * first_block, 16 * (first_block + 2)))
    data = np.random.default_rng(seed).integers(1, 255, size=(2, BB), dtype=np.uint8)
    assert transport.write(server.address, NS_DIGEST, keys, data).stored == 2
    out = np.zeros_like(data)
    assert transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in keys], list(out)).ok == 0
    return out


def test_bytes_sent_after_a_timeout_never_reach_the_callers_rows(
    node: PoolNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpool.transport import ucx

    # Model the worst case of a cancel that does not take (a receive UCX had already matched
    # when it timed out, or a request object outlives the read in a traceback or a cycle):
    # the dropped link keeps its posted receives alive and its worker is progressed later.
    dropped: list[ucx._Link] = []
    posted: list[list[Any]] = []
    wait = ucx._Link.wait

    def keeping_wait(self: ucx._Link, requests: list[Any], deadline: float) -> None:
        if not self.blocking:  # the reader's receives (the server's link blocks in epoll)
            posted.append(requests)
        wait(self, requests, deadline)

    monkeypatch.setattr(ucx._Link, "close", lambda self: dropped.append(self))
    monkeypatch.setattr(ucx._Link, "wait", keeping_wait)

    server: Any = late_server(NodeBlockStore(node))
    server.start()
    transport = ucx.UcxTransport(timeout_s=0.3, direct=False)
    try:
        keys = block_hashes(NS, np.arange(16 * 3))
        data = np.random.default_rng(11).integers(1, 255, size=(3, BB), dtype=np.uint8)
        assert transport.write(server.address, NS_DIGEST, keys, data).stored == 3
        out = np.zeros_like(data)
        result = transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in keys], list(out))
        assert result.ok == 0 and server.address in result.reason
        assert len(dropped) == 1
        assert posted
        deadline = time.monotonic() + SEND_DELAY_S + 5.0
        while not all(r.completed for r in posted[-1]) and time.monotonic() < deadline:
            dropped[0].worker.progress()  # until the late sends have arrived and are matched
        assert all(r.completed for r in posted[-1])  # the late bytes did arrive
        assert not out.any(), "late UCX bytes landed in rows already reported as a miss"
    finally:
        transport.close()
        server.stop()


def test_a_timed_out_read_leaves_no_receive_posted(node: PoolNode, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing the link cancels the receives and progresses them to completion before the
    read returns its miss: nothing stays posted against any buffer."""
    from kvpool.transport import ucx

    posted: list[list[Any]] = []
    wait = ucx._Link.wait

    def keeping_wait(self: ucx._Link, requests: list[Any], deadline: float) -> None:
        if not self.blocking:
            posted.append(requests)
        wait(self, requests, deadline)

    monkeypatch.setattr(ucx._Link, "wait", keeping_wait)
    server: Any = late_server(NodeBlockStore(node))
    server.start()
    transport = ucx.UcxTransport(timeout_s=0.3, direct=False)
    try:
        out = timed_out_read(server, transport, 2, 12)
        assert len(posted) == 1 and all(r.completed for r in posted[0])
        assert server.sent.wait(SEND_DELAY_S + 5.0)  # the late sends went out, to a worker that is gone
        assert not out.any()
    finally:
        transport.close()
        server.stop()


def test_a_timed_out_direct_read_retires_its_link_and_nothing_lands_later(
    node: PoolNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A direct receive UCX has matched cannot be cancelled, and only a progress call of the
    reader's worker moves its bytes (rendezvous by get: ``CONTEXT_CONFIG``): the retired link is
    never waited on, closed or progressed again, so the late sends land nowhere."""
    from kvpool.transport import ucx

    touched: list[ucx._Link] = []
    wait, close = ucx._Link.wait, ucx._Link.close

    def watched_wait(self: ucx._Link, requests: list[Any], deadline: float) -> None:
        if self.retired:
            touched.append(self)
        wait(self, requests, deadline)

    def watched_close(self: ucx._Link) -> None:
        if self.retired:
            touched.append(self)
        close(self)

    monkeypatch.setattr(ucx._Link, "wait", watched_wait)
    monkeypatch.setattr(ucx._Link, "close", watched_close)
    server: Any = late_server(NodeBlockStore(node))
    server.start()
    transport = ucx.UcxTransport(timeout_s=0.3, direct=True)
    try:
        out = timed_out_read(server, transport, 8, 15)
        assert transport.counters["retired_links"] == 1 and transport._retired[0].retired
        assert server.sent.wait(SEND_DELAY_S + 5.0)  # the late sends went out
        time.sleep(0.2)
        assert not out.any(), "late UCX bytes landed in rows already reported as a miss"
        transport.close()
        assert not touched  # the retired link was never driven again, not even by close
    finally:
        transport.close()
        server.stop()


def test_an_oversized_staging_buffer_is_let_go_after_the_read(node: PoolNode, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.transport import ucx

    monkeypatch.setattr(ucx, "STAGING_KEEP_BYTES", BB)
    server = ucx.UcxDataServer(NodeBlockStore(node), "127.0.0.1:0")
    server.start()
    transport = ucx.UcxTransport(timeout_s=3.0, direct=False)
    try:
        keys = block_hashes(NS, np.arange(16 * 4, 16 * 7))
        data = np.random.default_rng(13).integers(0, 255, size=(3, BB), dtype=np.uint8)
        assert transport.write(server.address, NS_DIGEST, keys, data).stored == 3
        out = np.zeros_like(data)
        assert transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in keys], list(out)).ok == 3
        np.testing.assert_array_equal(out, data)
        (link,) = transport._links.values()
        assert link._staging.nbytes == 0  # 3 blocks > the kept size: dropped once complete
        one = np.zeros(BB, dtype=np.uint8)
        assert transport.read(server.address, NS_DIGEST, [ReadItem(keys[1])], [one]).ok == 1
        np.testing.assert_array_equal(one, data[1])
        assert link._staging.nbytes == BB  # one block fits: kept for the next read
        assert link.runs  # the server offered READ_UCX_RUNS in UCX_HELLO
    finally:
        transport.close()
        server.stop()


def test_a_node_out_of_read_leases_refuses_and_the_ucx_connection_stays(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvpool.transport import ucx

    config = DaemonConfig(
        arena_dir=str(tmp_path), store=StoreConfig(capacity_bytes=4 << 20, slab_bytes=64 << 10, max_leases=1)
    )
    node = PoolNode(config, MonotonicClock())
    node.register(HASH_SCHEME, SPEC, NS_DIGEST, SPEC.digest())
    server = ucx.UcxDataServer(NodeBlockStore(node), "127.0.0.1:0")
    server.start()
    transport = ucx.UcxTransport(timeout_s=3.0)
    try:
        keys = block_hashes(NS, np.arange(16 * 2))
        data = np.random.default_rng(14).integers(0, 255, size=(2, BB), dtype=np.uint8)
        assert transport.write(server.address, NS_DIGEST, keys, data).stored == 2
        out = np.zeros_like(data)
        assert transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in keys], list(out)).ok == 2
        (link,) = transport._links.values()
        deadline = time.monotonic() + 5  # the server releases once its sends report completion
        while node.store.summary()["leases_active"] and time.monotonic() < deadline:
            time.sleep(0.01)
        held = node.store.lease(block_keys(NS_DIGEST, keys[:1]))
        refused = transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in keys], list(out))
        assert refused.ok == 0 and "max_leases" in refused.reason
        node.store.release(held.lease_id)
        out[:] = 0
        assert transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in keys], list(out)).ok == 2
        assert list(transport._links.values()) == [link]  # same upgraded connection, tags in step
        np.testing.assert_array_equal(out, data)
    finally:
        transport.close()
        server.stop()
        node.close()
