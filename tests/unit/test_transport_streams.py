"""Reads spread over several connections at once (``TcpTransport(streams=)``), on each data
plane against a real PoolNode arena: the bytes, the "leading rows that verified" count, a
rotten block or a gap in a later stream, and the parts themselves (property)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.keys import block_key
from kvpool.daemon.cluster_node import NodeBlockStore
from kvpool.daemon.node import PoolNode
from kvpool.transport.base import ReadItem
from kvpool.transport.factory import make_data_server, make_transport, nixl_available, ucx_available
from kvpool.transport.tcp import STREAM_MIN_BYTES, TcpTransport, default_streams, stream_parts
from tests.unit.transport_helpers import BB, NS_DIGEST, blocks, keys, make_node

KINDS = [
    "tcp",
    pytest.param("ucx", marks=[pytest.mark.ucx, pytest.mark.skipif(bool(ucx_available()), reason="ucxx unusable")]),
    pytest.param("nixl", marks=pytest.mark.skipif(bool(nixl_available()), reason="nixl unusable")),
]
STREAMS = 4
PART_BYTES = 16 * BB  # a 64-block read is cut into 4 parts of 16


@pytest.fixture(params=KINDS)
def plane(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[PoolNode, str, TcpTransport]]:
    node = make_node(tmp_path)
    server = make_data_server(request.param, NodeBlockStore(node), "127.0.0.1:0")
    server.start()
    transport = make_transport(request.param, timeout_s=5.0, streams=STREAMS)
    assert isinstance(transport, TcpTransport)
    transport.stream_min_bytes = PART_BYTES
    yield node, server.address, transport
    transport.close()
    server.stop()
    node.close()


def read_all(transport: TcpTransport, address: str, ks: list[bytes], out: np.ndarray) -> tuple[int, int, str]:
    got = transport.read(address, NS_DIGEST, [ReadItem(k) for k in ks], list(out))
    return got.ok, got.corrupt_index, got.reason


def test_a_read_in_four_streams_lands_every_byte_verified(plane: tuple[PoolNode, str, TcpTransport]) -> None:
    _, address, transport = plane
    ks, data = keys(64, 1000), blocks(64, 11)
    assert transport.write(address, NS_DIGEST, ks, data).stored == 64
    seen: set[str] = set()
    read_part = transport._read_part

    def spy(*args: object) -> object:
        seen.add(threading.current_thread().name)
        return read_part(*args)  # type: ignore[arg-type]

    transport._read_part = spy  # type: ignore[method-assign]
    for _ in range(3):  # connections come back to the pool and are reused in step
        out = np.zeros_like(data)
        assert read_all(transport, address, ks, out) == (64, -1, "")
        np.testing.assert_array_equal(out, data)
    assert len(seen) >= 2 and any("stream" in name for name in seen)  # the parts ran on other threads too


def test_a_gap_in_a_later_stream_ends_the_leading_rows_there(plane: tuple[PoolNode, str, TcpTransport]) -> None:
    node, address, transport = plane
    ks, data = keys(64, 2000), blocks(64, 12)
    transport.write(address, NS_DIGEST, ks, data)
    assert node.store.remove([block_key(NS_DIGEST, ks[40])]) == 1  # in the third of four parts
    out = np.zeros_like(data)
    ok, corrupt, reason = read_all(transport, address, ks, out)
    assert (ok, corrupt) == (40, -1) and "holds only" in reason
    np.testing.assert_array_equal(out[:40], data[:40])


def test_a_rotten_block_in_a_later_stream_is_a_miss_named_by_its_index_in_the_read(
    plane: tuple[PoolNode, str, TcpTransport],
) -> None:
    node, address, transport = plane
    ks, data = keys(64, 3000), blocks(64, 13)
    transport.write(address, NS_DIGEST, ks, data)
    entry = node.store.entry(block_key(NS_DIGEST, ks[50]))
    assert entry is not None
    node.arena.view[entry.offset + 9] ^= 0x10  # bit rot in the fourth part
    out = np.zeros_like(data)
    ok, corrupt, reason = read_all(transport, address, ks, out)
    assert (ok, corrupt) == (50, 50) and "checksum" in reason  # the reader reports ks[50] to its node
    np.testing.assert_array_equal(out[:50], data[:50])


def test_a_stopped_node_is_a_miss_on_every_stream(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    server = make_data_server("tcp", NodeBlockStore(node), "127.0.0.1:0")
    server.start()
    transport = TcpTransport(timeout_s=2.0, streams=STREAMS, stream_min_bytes=PART_BYTES)
    try:
        ks = keys(64, 4000)
        transport.write(server.address, NS_DIGEST, ks, blocks(64, 14))
        server.stop()
        ok, _, reason = read_all(transport, server.address, ks, np.zeros((64, BB), dtype=np.uint8))
        assert ok == 0 and server.address in reason
    finally:
        transport.close()
        node.close()


def test_streams_are_bounded_and_one_sided_planes_default_to_the_cores() -> None:
    assert TcpTransport().streams == default_streams(one_sided=False) == 1
    assert 1 <= default_streams(one_sided=True) == min(4, os.cpu_count() or 1)
    if not ucx_available():
        ucx = make_transport("ucx")
        assert ucx.streams == default_streams(one_sided=True)  # type: ignore[attr-defined]
        ucx.close()
    assert TcpTransport(streams=2).streams == 2
    with pytest.raises(Exception, match="streams must be"):
        TcpTransport(streams=99)
    # a read below two parts' worth of bytes stays on one connection
    assert stream_parts([STREAM_MIN_BYTES // 4] * 7, 4) == [(0, 7)]
    assert len(stream_parts([1 << 20] * 32, 2)) == 2


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.integers(1, 64), min_size=1, max_size=80),
    streams=st.integers(1, 8),
    min_bytes=st.integers(1, 256),
)
def test_parts_cover_every_row_once_in_order_and_none_is_empty(rows: list[int], streams: int, min_bytes: int) -> None:
    parts = stream_parts(rows, streams, min_bytes)
    assert parts[0][0] == 0 and parts[-1][1] == len(rows)
    assert all(a < b for a, b in parts)  # none empty
    assert all(parts[i][1] == parts[i + 1][0] for i in range(len(parts) - 1))  # adjacent, in order
    assert 1 <= len(parts) <= max(1, min(streams, len(rows), sum(rows) // min_bytes))
    if len(set(rows)) == 1 and len(rows) % len(parts) == 0:  # equal rows: equal parts
        assert len({b - a for a, b in parts}) == 1
