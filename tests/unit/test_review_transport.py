"""Review findings on the TCP data plane (kvpool/transport/tcp.py): each test pins a bug
the review found (now fixed), so it cannot come back."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import transport_helpers as helpers
from transport_helpers import BB, NS, NS_DIGEST, SPEC, make_node

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.hashing import block_hashes
from kvpool.core.keys import block_key
from kvpool.daemon.cluster_node import NodeBlockStore
from kvpool.daemon.node import PoolNode
from kvpool.transport import wire
from kvpool.transport.base import ReadItem
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_server import TcpDataServer

node, server, transport = helpers.node, helpers.server, helpers.transport  # the shared fixtures


class _FakePeer:
    """A scripted data-plane peer on a loopback port: accepts one connection and hands it
    to ``answer``; subclasses say what the (misbehaving) peer sends back."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            try:
                self.answer(conn)
            except OSError:
                pass

    def answer(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        self.thread.join(2.0)


def test_layer_range_read_of_a_rotted_block_is_a_miss(
    server: TcpDataServer, transport: TcpTransport, node: PoolNode
) -> None:
    ks = block_hashes(NS, np.arange(0, 8))
    data = np.random.default_rng(7).integers(0, 255, size=(1, BB), dtype=np.uint8)
    assert transport.write(server.address, NS_DIGEST, ks, data).stored == 1
    entry = node.store.entry(block_key(NS_DIGEST, ks[0]))
    assert entry is not None
    offset, length = SPEC.layer_range_bytes(1, 2)
    node.arena.view[entry.offset + offset + 3] ^= 0xFF  # bit rot inside layer 1 after commit
    # the whole-block read catches it ...
    whole = np.zeros(BB, dtype=np.uint8)
    assert transport.read(server.address, NS_DIGEST, [ReadItem(ks[0])], [whole]).ok == 0
    # ... the layer-range read of the same bytes must too (it is the same wrong KV)
    out = np.zeros(length, dtype=np.uint8)
    got = transport.read(server.address, NS_DIGEST, [ReadItem(ks[0], offset, length)], [out])
    served_wrong = got.ok == 1 and not np.array_equal(out, data[0, offset : offset + length])
    assert not served_wrong, "wrong KV served as a verified layer-range hit"
    assert got.ok == 0


class _LyingPeer(_FakePeer):
    """A data-plane peer that answers every READ with more items than were asked for."""

    def __init__(self, served: int, item_bytes: int) -> None:
        self.served = served
        self.item_bytes = item_bytes
        super().__init__()

    def answer(self, conn: socket.socket) -> None:
        _, count, _ = wire.unpack_header(wire.recv_exact(conn, wire.HEADER.size))
        wire.recv_exact(conn, count * wire.READ_ITEM.size)
        payload = bytes(self.item_bytes)
        metas = b"".join(wire.READ_META.pack(self.item_bytes, 0) for _ in range(self.served))
        conn.sendall(wire.pack_reply(wire.STATUS_OK, self.served) + metas + payload * self.served)


def test_peer_claiming_more_items_than_asked_is_a_miss(transport: TcpTransport) -> None:
    peer = _LyingPeer(served=3, item_bytes=64)
    try:
        key = bytes(range(16))
        out = np.zeros(64, dtype=np.uint8)
        result = transport.read(peer.address, NS_DIGEST, [ReadItem(key)], [out])  # raises IndexError today
        assert result.ok == 0 and result.reason
    finally:
        peer.close()


class _TricklingPeer(_FakePeer):
    """A peer that answers a READ correctly but sends the block one byte at a time, each
    byte well inside the transport's timeout, the whole block far outside it."""

    def __init__(self, payload: bytes, byte_interval_s: float) -> None:
        self.payload = payload
        self.byte_interval_s = byte_interval_s
        super().__init__()

    def answer(self, conn: socket.socket) -> None:
        _, count, _ = wire.unpack_header(wire.recv_exact(conn, wire.HEADER.size))
        wire.recv_exact(conn, count * wire.READ_ITEM.size)
        meta = wire.READ_META.pack(len(self.payload), checksum64(np.frombuffer(self.payload, np.uint8)))
        conn.sendall(wire.pack_reply(wire.STATUS_OK, 1) + meta)
        for i in range(len(self.payload)):
            if self.stop.wait(self.byte_interval_s):  # models a slow peer, not a sync
                return
            conn.sendall(self.payload[i : i + 1])


def test_a_trickling_peer_cannot_hold_a_read_past_its_timeout() -> None:
    payload = bytes(range(40))
    peer = _TricklingPeer(payload, byte_interval_s=0.05)  # 2 s in all, 50 ms per byte
    transport = TcpTransport(timeout_s=0.5)
    try:
        out = np.zeros(len(payload), dtype=np.uint8)
        result = transport.read(peer.address, NS_DIGEST, [ReadItem(bytes(16))], [out])
        # the whole transfer took ~4x timeout_s: it must have been cut off as a miss
        assert result.ok == 0 and result.reason
    finally:
        transport.close()
        peer.close()


@pytest.fixture
def fake_clock_node(tmp_path) -> Iterator[tuple[PoolNode, FakeClock]]:  # type: ignore[no-untyped-def]
    clock = FakeClock()
    pool_node = make_node(tmp_path, clock)
    yield pool_node, clock
    pool_node.close()


def _reclaimed_slow_write_keeps_the_other_block(
    node: PoolNode, clock: FakeClock, transport: TcpTransport, store: NodeBlockStore
) -> None:
    srv = TcpDataServer(store, "127.0.0.1:0")
    srv.start()
    try:
        slow_key, other_key = block_hashes(NS, np.arange(0, 16))
        host, port = srv.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5.0) as slow:
            # a writer that sends its request and half of its block, then stalls
            slow.sendall(
                wire.pack_header(wire.OP_WRITE, 1, NS_DIGEST)
                + wire.U64.pack(BB)
                + wire.WRITE_ITEM.pack(slow_key, 0)
                + bytes(BB // 2)
            )
            pending = node.store.summary
            for _ in range(500):  # wait until the server has reserved the slot (put_start done)
                if pending().get("pending_puts", 0):
                    break
                threading.Event().wait(0.01)
            assert pending().get("pending_puts", 0) == 1, pending()
            clock.advance(node.config.store.put_ttl_ms + 1)
            assert node.store.sweep()[1] == 1  # the stalled put is reclaimed, its slot freed
            good = np.random.default_rng(3).integers(0, 255, size=(1, BB), dtype=np.uint8)
            assert transport.write(srv.address, NS_DIGEST, [other_key], good).stored == 1
            # the stalled writer wakes up and sends the rest of its (reclaimed) block
            slow.sendall(b"\xff" * (BB - BB // 2))
            slow.settimeout(5.0)
            try:
                slow.recv(64)  # the server answers or drops the connection once it is done
            except OSError:
                pass
        out = np.zeros((1, BB), dtype=np.uint8)
        got = transport.read(srv.address, NS_DIGEST, [ReadItem(other_key)], list(out))
        assert got.ok == 1, "a committed block was overwritten by a reclaimed writer"
        np.testing.assert_array_equal(out, good)
    finally:
        srv.stop()


def test_a_reclaimed_slow_write_cannot_overwrite_another_committed_block(
    fake_clock_node: tuple[PoolNode, FakeClock], transport: TcpTransport
) -> None:
    node, clock = fake_clock_node
    _reclaimed_slow_write_keeps_the_other_block(node, clock, transport, NodeBlockStore(node))
    assert node.store.summary().get("pending_puts", 0) == 0  # the stale put left nothing behind


def test_write_slot_refuses_a_reclaimed_put(fake_clock_node: tuple[PoolNode, FakeClock]) -> None:
    node, clock = fake_clock_node
    store = node.store
    key_a, key_b = block_hashes(NS, np.arange(0, 16))
    grant = store.put_start(NS_DIGEST, [key_a], BB)
    block = np.full(BB, 7, dtype=np.uint8)
    assert store.write_slot(grant.put_id, 0, block)  # pending: copied into its slot
    offset = grant.slots[0][1]
    assert np.array_equal(node.arena.view[offset : offset + BB], block)
    assert not store.write_slot(grant.put_id, 1, block)  # not one of its slots
    assert not store.write_slot(grant.put_id, 0, block[:-1])  # not one block
    clock.advance(node.config.store.put_ttl_ms + 1)
    assert store.sweep()[1] == 1
    other = store.put_start(NS_DIGEST, [key_b], BB)
    assert not store.write_slot(grant.put_id, 0, np.full(BB, 9, dtype=np.uint8))  # reclaimed: refused
    reused = other.slots[0][1]
    assert not (node.arena.view[reused : reused + BB] == 9).any()


class _OverCountingWritePeer(_FakePeer):
    """A peer that accepts a WRITE and reports more outcomes than blocks were sent."""

    def answer(self, conn: socket.socket) -> None:
        _, count, _ = wire.unpack_header(wire.recv_exact(conn, wire.HEADER.size))
        (block_bytes,) = wire.U64.unpack(wire.recv_exact(conn, wire.U64.size))
        wire.recv_exact(conn, count * (wire.WRITE_ITEM.size + block_bytes))
        conn.sendall(wire.pack_reply(wire.STATUS_OK, 0) + wire.WRITE_COUNTS.pack(count + 5, 0, 0, 0))


def test_peer_reporting_more_write_outcomes_than_blocks_is_a_failed_write(transport: TcpTransport) -> None:
    peer = _OverCountingWritePeer()
    try:
        rows = np.zeros((2, 64), dtype=np.uint8)
        result = transport.write(peer.address, NS_DIGEST, [bytes(16), bytes(range(16))], rows)
        assert result.stored == 0 and result.reason  # not believed: nothing known to be stored
    finally:
        peer.close()


def test_layer_range_read_of_a_healthy_block_is_still_served(server: TcpDataServer, transport: TcpTransport) -> None:
    ks = block_hashes(NS, np.arange(0, 16))
    data = np.random.default_rng(11).integers(0, 255, size=(2, BB), dtype=np.uint8)
    wrote = transport.write(server.address, NS_DIGEST, ks, data)
    assert wrote.stored == 2, wrote
    offset, length = SPEC.layer_range_bytes(2, 1)
    outs = [np.zeros(length, dtype=np.uint8) for _ in ks]
    got = transport.read(server.address, NS_DIGEST, [ReadItem(k, offset, length) for k in ks], outs)
    assert got.ok == 2
    for row, out in zip(data, outs, strict=True):
        np.testing.assert_array_equal(out, row[offset : offset + length])


@pytest.mark.ucx
def test_layer_range_read_of_a_rotted_block_is_a_miss_over_ucx(node: PoolNode) -> None:
    from kvpool.transport.factory import make_data_server, make_transport, ucx_available

    if ucx_available():
        pytest.skip(f"ucxx unusable: {ucx_available()}")
    srv = make_data_server("ucx", NodeBlockStore(node), "127.0.0.1:0")
    srv.start()
    reader = make_transport("ucx", timeout_s=5.0)
    try:
        ks = block_hashes(NS, np.arange(0, 16))
        data = np.random.default_rng(5).integers(0, 255, size=(2, BB), dtype=np.uint8)
        assert reader.write(srv.address, NS_DIGEST, ks, data).stored == 2
        entry = node.store.entry(block_key(NS_DIGEST, ks[1]))
        assert entry is not None
        node.arena.view[entry.offset + BB - 1] ^= 0xFF  # rot outside the range that is read
        offset, length = SPEC.layer_range_bytes(0, 1)
        outs = [np.zeros(length, dtype=np.uint8) for _ in ks]
        got = reader.read(srv.address, NS_DIGEST, [ReadItem(k, offset, length) for k in ks], outs)
        assert got.ok == 1 and got.reason  # block 0 is healthy; the rotted block 1 is a miss
        np.testing.assert_array_equal(outs[0], data[0, offset : offset + length])
    finally:
        reader.close()
        srv.stop()
