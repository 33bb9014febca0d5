"""Review findings on the TCP data plane (kvpool/transport/tcp.py): each test is a bug
that exists today, marked strict xfail so the suite stays green until it is fixed."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.core.clock import FakeClock, MonotonicClock
from kvpool.core.config import DaemonConfig, StoreConfig
from kvpool.core.hashing import HASH_SCHEME, block_hashes
from kvpool.core.spec import KVSpec, Namespace
from kvpool.daemon.cluster_node import NodeBlockStore
from kvpool.daemon.node import PoolNode
from kvpool.transport import wire
from kvpool.transport.base import ReadItem
from kvpool.transport.tcp import TcpDataServer, TcpTransport

SPEC = KVSpec(model="tiny", num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=8)
NS = Namespace(SPEC, b"review")
NS_DIGEST = NS.digest()
BB = SPEC.block_bytes


@pytest.fixture
def node(tmp_path) -> Iterator[PoolNode]:  # type: ignore[no-untyped-def]
    config = DaemonConfig(arena_dir=str(tmp_path), store=StoreConfig(capacity_bytes=4 << 20, slab_bytes=64 << 10))
    pool_node = PoolNode(config, MonotonicClock())
    pool_node.register(HASH_SCHEME, SPEC, NS_DIGEST, SPEC.digest())
    yield pool_node
    pool_node.close()


@pytest.fixture
def server(node: PoolNode) -> Iterator[TcpDataServer]:
    srv = TcpDataServer(NodeBlockStore(node), "127.0.0.1:0")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def transport() -> Iterator[TcpTransport]:
    t = TcpTransport(timeout_s=2.0)
    yield t
    t.close()


@pytest.mark.xfail(
    strict=True,
    reason="BUG: a byte-range (layer) read is checksummed by the server over whatever bytes the arena "
    "holds now (tcp.py _lease_for_read), never against the block's committed checksum, so a block "
    "that rotted in the arena is served as a verified hit",
)
def test_layer_range_read_of_a_rotted_block_is_a_miss(
    server: TcpDataServer, transport: TcpTransport, node: PoolNode
) -> None:
    ks = block_hashes(NS, np.arange(0, 8))
    data = np.random.default_rng(7).integers(0, 255, size=(1, BB), dtype=np.uint8)
    assert transport.write(server.address, NS_DIGEST, ks, data).stored == 1
    entry = node.store.entry(ks[0])
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


class _LyingPeer:
    """A data-plane peer that answers every READ with more items than were asked for."""

    def __init__(self, served: int, item_bytes: int) -> None:
        self.served = served
        self.item_bytes = item_bytes
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
            _, count, _ = wire.unpack_header(wire.recv_exact(conn, wire.HEADER.size))
            wire.recv_exact(conn, count * wire.READ_ITEM.size)
            payload = bytes(self.item_bytes)
            metas = b"".join(wire.READ_META.pack(self.item_bytes, 0) for _ in range(self.served))
            try:
                conn.sendall(wire.pack_reply(wire.STATUS_OK, self.served) + metas + payload * self.served)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
        self.thread.join(2.0)


@pytest.mark.xfail(
    strict=True,
    reason="BUG: a peer whose READ reply claims more items than were requested makes "
    "TcpTransport._read_chunk index dst out of range; the IndexError escapes read() (and "
    "ClusterClient.get_into) instead of becoming a miss",
)
def test_peer_claiming_more_items_than_asked_is_a_miss(transport: TcpTransport) -> None:
    peer = _LyingPeer(served=3, item_bytes=64)
    try:
        key = bytes(range(16))
        out = np.zeros(64, dtype=np.uint8)
        result = transport.read(peer.address, NS_DIGEST, [ReadItem(key)], [out])  # raises IndexError today
        assert result.ok == 0 and result.reason
    finally:
        peer.close()


class _TricklingPeer:
    """A peer that answers a READ correctly but sends the block one byte at a time, each
    byte well inside the transport's timeout, the whole block far outside it."""

    def __init__(self, payload: bytes, byte_interval_s: float) -> None:
        self.payload = payload
        self.byte_interval_s = byte_interval_s
        self.stop = threading.Event()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        from kvpool.core.checksum import checksum64

        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            _, count, _ = wire.unpack_header(wire.recv_exact(conn, wire.HEADER.size))
            wire.recv_exact(conn, count * wire.READ_ITEM.size)
            meta = wire.READ_META.pack(len(self.payload), checksum64(np.frombuffer(self.payload, np.uint8)))
            try:
                conn.sendall(wire.pack_reply(wire.STATUS_OK, 1) + meta)
                for i in range(len(self.payload)):
                    if self.stop.wait(self.byte_interval_s):  # models a slow peer, not a sync
                        return
                    conn.sendall(self.payload[i : i + 1])
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        self.thread.join(2.0)


@pytest.mark.xfail(
    strict=True,
    reason="BUG: TcpTransport's timeout_s is a per-recv socket timeout, not a deadline for the "
    "transfer: a peer that keeps trickling bytes holds read() (and ClusterClient.get_into) for "
    "as long as it likes instead of the transfer timing out and becoming a miss",
)
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
    config = DaemonConfig(arena_dir=str(tmp_path), store=StoreConfig(capacity_bytes=4 << 20, slab_bytes=64 << 10))
    pool_node = PoolNode(config, clock)
    pool_node.register(HASH_SCHEME, SPEC, NS_DIGEST, SPEC.digest())
    yield pool_node, clock
    pool_node.close()


@pytest.mark.xfail(
    strict=True,
    reason="BUG: TcpDataServer._serve_write receives a slow peer's block straight into the arena slot "
    "its put_start reserved; once the put is reclaimed (put_ttl_ms, store sweep) the slot is reused "
    "by another put, and the stale stream overwrites that committed block: stored data is lost to "
    "a slow or bad writer (readers then see a checksum failure)",
)
def test_a_reclaimed_slow_write_cannot_overwrite_another_committed_block(
    fake_clock_node: tuple[PoolNode, FakeClock], transport: TcpTransport
) -> None:
    node, clock = fake_clock_node
    srv = TcpDataServer(NodeBlockStore(node), "127.0.0.1:0")
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
