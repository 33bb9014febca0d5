"""The TCP data plane against a real PoolNode arena: full and byte-range reads, writes,
checksums verified on arrival, and failures that become misses naming the peer."""

from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np
import pytest
import transport_helpers as helpers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transport_helpers import BB, NS_DIGEST, SPEC, blocks, keys

from kvpool.core.hashing import HASH_SCHEME
from kvpool.core.keys import block_key, block_keys
from kvpool.core.spec import Namespace
from kvpool.daemon.node import PoolNode
from kvpool.transport.base import ReadItem
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_server import TcpDataServer

node, server, transport = helpers.node, helpers.server, helpers.transport  # the shared fixtures


def test_write_then_read_whole_blocks(server: TcpDataServer, transport: TcpTransport, node: PoolNode) -> None:
    data = blocks(6, 1)
    ks = keys(6)
    result = transport.write(server.address, NS_DIGEST, ks, data)
    assert (result.stored, result.already_present, result.reason) == (6, 0, "")
    again = transport.write(server.address, NS_DIGEST, ks, data)
    assert (again.stored, again.already_present) == (0, 6)
    out = np.zeros_like(data)
    got = transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out))
    assert got.ok == 6 and got.reason == ""
    np.testing.assert_array_equal(out, data)
    deadline = time.monotonic() + 5  # the server releases its read lease after its last send
    while node.store.summary()["leases_active"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert node.store.summary()["leases_active"] == 0


def test_read_stops_at_first_block_the_node_lacks(server: TcpDataServer, transport: TcpTransport) -> None:
    ks = keys(5)
    transport.write(server.address, NS_DIGEST, ks[:3], blocks(3, 2))
    out = np.zeros((5, BB), dtype=np.uint8)
    got = transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out))
    assert got.ok == 3
    assert "3 of 5" in got.reason


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=st.integers(0, 3), count=st.integers(1, 4), block=st.integers(0, 3))
def test_layer_range_reads_match_the_source(
    server: TcpDataServer, transport: TcpTransport, first: int, count: int, block: int
) -> None:
    count = min(count, SPEC.num_layers - first)
    data = blocks(4, 3)
    ks = keys(4, 100)
    transport.write(server.address, NS_DIGEST, ks, data)
    offset, length = SPEC.layer_range_bytes(first, count)
    out = np.zeros(length, dtype=np.uint8)
    got = transport.read(server.address, NS_DIGEST, [ReadItem(ks[block], offset, length)], [out])
    assert got.ok == 1
    np.testing.assert_array_equal(out, data[block, offset : offset + length])


def test_corrupt_block_is_a_miss_logged_with_peer(
    server: TcpDataServer, transport: TcpTransport, node: PoolNode, caplog: pytest.LogCaptureFixture
) -> None:
    ks = keys(4, 200)
    transport.write(server.address, NS_DIGEST, ks, blocks(4, 4))
    entry = node.store.entry(block_key(NS_DIGEST, ks[2]))
    assert entry is not None
    node.arena.view[entry.offset + 7] ^= 0xFF  # bit rot after commit
    out = np.zeros((4, BB), dtype=np.uint8)
    with caplog.at_level(logging.WARNING, logger="kvpool.transport"):
        got = transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out))
    assert got.ok == 2
    assert server.address in caplog.text and "checksum" in caplog.text
    # the connection stayed in sync: the next read works
    again = transport.read(server.address, NS_DIGEST, [ReadItem(ks[0])], [out[0]])
    assert again.ok == 1


def test_corrupt_whole_block_names_its_index_for_the_reader_to_report(
    server: TcpDataServer, transport: TcpTransport, node: PoolNode
) -> None:
    ks = keys(4, 220)
    transport.write(server.address, NS_DIGEST, ks, blocks(4, 6))
    entry = node.store.entry(block_key(NS_DIGEST, ks[1]))
    assert entry is not None
    node.arena.view[entry.offset + 3] ^= 0x01
    out = np.zeros((4, BB), dtype=np.uint8)
    got = transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out))
    assert (got.ok, got.corrupt_index) == (1, 1)  # the reader reports ks[1] to the node (ClusterClient)
    missing = transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in keys(2, 900)], list(out[:2]))
    assert (missing.ok, missing.corrupt_index) == (0, -1)  # a plain miss is not corruption


def test_rot_found_serving_a_range_read_is_dropped_by_the_node(
    server: TcpDataServer, transport: TcpTransport, node: PoolNode
) -> None:
    ks = keys(3, 240)
    data = blocks(3, 7)
    transport.write(server.address, NS_DIGEST, ks, data)
    entry = node.store.entry(block_key(NS_DIGEST, ks[1]))
    assert entry is not None
    node.arena.view[entry.offset + BB - 1] ^= 0x10  # rot outside the range the reader asks for
    seq = node.events.last_seq
    offset, length = SPEC.layer_range_bytes(0, 1)
    out = np.zeros((3, length), dtype=np.uint8)
    got = transport.read(server.address, NS_DIGEST, [ReadItem(k, offset, length) for k in ks], list(out))
    assert got.ok == 1
    np.testing.assert_array_equal(out[0], data[0, offset : offset + length])
    assert node.store.lookup(block_keys(NS_DIGEST, ks)) == 1  # the node dropped ks[1] itself
    assert node.store.summary()["checksum_failures"] == 1
    removed = [e for e in node.events.read_from(seq + 1, 0.0) if e.kind.value == "removed"]
    assert [e.hashes for e in removed] == [(ks[1],)]
    again = transport.write(server.address, NS_DIGEST, ks, data)  # the next put heals it
    assert (again.stored, again.already_present) == (1, 2)
    assert transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in ks], list(np.zeros_like(data))).ok == 3


def test_write_with_bad_checksum_is_not_stored(server: TcpDataServer, node: PoolNode) -> None:
    from kvpool.transport import wire

    ks = keys(1, 300)
    data = blocks(1, 5)
    with socket.create_connection(("127.0.0.1", int(server.address.rsplit(":", 1)[1]))) as sock:
        sock.sendall(
            wire.pack_header(wire.OP_WRITE, 1, NS_DIGEST) + wire.U64.pack(BB) + wire.WRITE_ITEM.pack(ks[0], 12345)
        )
        sock.sendall(data[0].tobytes())
        status, _, _ = wire.recv_reply(sock)
        counts = wire.WRITE_COUNTS.unpack(wire.recv_exact(sock, wire.WRITE_COUNTS.size))
    assert status == wire.STATUS_OK and counts == (0, 0, 0, 1)
    assert node.store.lookup(block_keys(NS_DIGEST, ks)) == 0


def test_unknown_namespace_is_refused(server: TcpDataServer, transport: TcpTransport) -> None:
    other = Namespace(SPEC, b"other-tenant").digest()
    out = np.zeros((1, BB), dtype=np.uint8)
    got = transport.read(server.address, other, [ReadItem(keys(1)[0])], list(out))
    assert got.ok == 0 and "not registered" in got.reason


def test_blocks_of_another_namespace_are_not_served(
    server: TcpDataServer, transport: TcpTransport, node: PoolNode
) -> None:
    """Knowing a hash is not enough: the reader's namespace must be the block's."""
    other = Namespace(SPEC, b"other-tenant")
    node.register(HASH_SCHEME, SPEC, other.digest(), SPEC.digest())
    ks = keys(2, 500)
    transport.write(server.address, NS_DIGEST, ks, blocks(2, 7))
    out = np.zeros((2, BB), dtype=np.uint8)
    assert transport.read(server.address, other.digest(), [ReadItem(k) for k in ks], list(out)).ok == 0
    assert transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out)).ok == 2


def test_unreachable_peer_is_a_miss_not_an_exception(transport: TcpTransport) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    out = np.zeros((2, BB), dtype=np.uint8)
    got = transport.read(f"127.0.0.1:{port}", NS_DIGEST, [ReadItem(k) for k in keys(2)], list(out))
    assert got.ok == 0 and f"127.0.0.1:{port}" in got.reason
    wrote = transport.write(f"127.0.0.1:{port}", NS_DIGEST, keys(2), out)
    assert wrote.stored == 0 and f"127.0.0.1:{port}" in wrote.reason


def test_silent_peer_times_out_as_a_miss(caplog: pytest.LogCaptureFixture) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    accepted: list[socket.socket] = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True)
    thread.start()
    transport = TcpTransport(timeout_s=0.3)
    out = np.zeros((1, BB), dtype=np.uint8)
    with caplog.at_level(logging.WARNING, logger="kvpool.transport"):
        got = transport.read(address, NS_DIGEST, [ReadItem(keys(1)[0])], list(out))
    assert got.ok == 0 and address in caplog.text
    transport.close()
    for conn in accepted:
        conn.close()
    listener.close()


def test_server_killed_mid_stream_leaves_only_verified_blocks(node: PoolNode) -> None:
    """A peer that dies after sending part of a batch: only fully arrived, verified blocks count."""
    from kvpool.transport import wire

    ks = keys(3, 400)
    data = blocks(3, 6)
    from kvpool.core.checksum import checksum64

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    address = f"127.0.0.1:{listener.getsockname()[1]}"

    def half_server() -> None:
        conn, _ = listener.accept()
        head = wire.recv_exact(conn, wire.HEADER.size)
        _, count, _ = wire.unpack_header(head)
        wire.recv_exact(conn, count * wire.READ_ITEM.size)
        metas = b"".join(wire.READ_META.pack(BB, checksum64(data[i])) for i in range(3))
        conn.sendall(wire.pack_reply(wire.STATUS_OK, 3) + metas + data[0].tobytes() + data[1].tobytes()[: BB // 2])
        conn.close()

    thread = threading.Thread(target=half_server, daemon=True)
    thread.start()
    transport = TcpTransport(timeout_s=2.0)
    out = np.zeros((3, BB), dtype=np.uint8)
    got = transport.read(address, NS_DIGEST, [ReadItem(k) for k in ks], list(out))
    thread.join(2)
    listener.close()
    transport.close()
    assert got.ok == 1
    np.testing.assert_array_equal(out[0], data[0])


@settings(max_examples=50, deadline=None)
@given(
    items=st.lists(
        st.tuples(st.binary(min_size=16, max_size=16), st.integers(0, 2**63), st.integers(0, 2**63)), max_size=20
    ),
    op=st.sampled_from([1, 2, 5]),
)
def test_wire_frames_round_trip(items: list[tuple[bytes, int, int]], op: int) -> None:
    from kvpool.transport import wire

    head = wire.pack_header(op, len(items), NS_DIGEST)
    assert wire.unpack_header(head) == (op, len(items), NS_DIGEST)
    assert wire.unpack_read_items(wire.pack_read_items(items), len(items)) == items


def test_wire_rejects_foreign_or_newer_peers() -> None:
    from kvpool.core.errors import InvalidArgument
    from kvpool.transport import wire

    good = wire.pack_header(wire.OP_READ, 1, NS_DIGEST)
    with pytest.raises(InvalidArgument, match="magic"):
        wire.unpack_header(b"HTTP" + good[4:])
    with pytest.raises(InvalidArgument, match="version"):
        wire.unpack_header(good[:4] + bytes([wire.VERSION + 1]) + good[5:])
    with pytest.raises(InvalidArgument, match="split the batch"):
        wire.pack_header(wire.OP_READ, wire.MAX_ITEMS + 1, NS_DIGEST)
