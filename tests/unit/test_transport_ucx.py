"""The UCX data plane (worker-address path) against a real PoolNode arena, in-process:
same checks as TCP (whole blocks, byte ranges, corruption as a miss, dead peer as a miss)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.core.clock import MonotonicClock
from kvpool.core.config import DaemonConfig, StoreConfig
from kvpool.core.hashing import HASH_SCHEME, block_hashes
from kvpool.core.keys import block_key
from kvpool.core.spec import KVSpec, Namespace
from kvpool.daemon.cluster_node import NodeBlockStore
from kvpool.daemon.node import PoolNode
from kvpool.transport.base import ReadItem
from kvpool.transport.factory import make_data_server, make_transport, ucx_available

pytestmark = [pytest.mark.ucx, pytest.mark.skipif(bool(ucx_available()), reason=f"ucxx unusable: {ucx_available()}")]

SPEC = KVSpec(model="tiny", num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)
NS = Namespace(SPEC, b"u")
NS_DIGEST = NS.digest()
BB = SPEC.block_bytes


@pytest.fixture
def setup(tmp_path) -> Iterator[tuple[PoolNode, object, object]]:  # type: ignore[no-untyped-def]
    config = DaemonConfig(arena_dir=str(tmp_path), store=StoreConfig(capacity_bytes=4 << 20, slab_bytes=64 << 10))
    node = PoolNode(config, MonotonicClock())
    node.register(HASH_SCHEME, SPEC, NS_DIGEST, SPEC.digest())
    server = make_data_server("ucx", NodeBlockStore(node), "127.0.0.1:0")
    server.start()
    transport = make_transport("ucx", timeout_s=3.0)
    yield node, server, transport
    transport.close()
    server.stop()
    node.close()


def test_ucx_reads_blocks_and_ranges_verified(setup, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    node, server, transport = setup
    assert transport.name == "ucx" and type(server).__name__ == "UcxDataServer"
    keys = block_hashes(NS, np.arange(16 * 6))
    data = np.random.default_rng(7).integers(0, 255, size=(6, BB), dtype=np.uint8)
    assert transport.write(server.address, NS_DIGEST, keys, data).stored == 6
    for _ in range(3):  # repeated reads on one upgraded connection keep their tags in step
        out = np.zeros_like(data)
        assert transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in keys], list(out)).ok == 6
        np.testing.assert_array_equal(out, data)
    offset, length = SPEC.layer_range_bytes(1, 2)
    part = np.zeros(length, dtype=np.uint8)
    assert transport.read(server.address, NS_DIGEST, [ReadItem(keys[3], offset, length)], [part]).ok == 1
    np.testing.assert_array_equal(part, data[3, offset : offset + length])
    # a prefix the node lacks, then corruption: misses, and the connection keeps working
    more = block_hashes(NS, np.arange(16 * 8))
    out8 = np.zeros((8, BB), dtype=np.uint8)
    assert transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in more], list(out8)).ok == 6
    entry = node.store.entry(block_key(NS_DIGEST, keys[1]))
    node.arena.view[entry.offset] ^= 0x5A
    with caplog.at_level(logging.WARNING, logger="kvpool.transport"):
        assert transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in keys], list(out)).ok == 1
    assert server.address in caplog.text
    assert transport.read(server.address, NS_DIGEST, [ReadItem(keys[0])], [out[0]]).ok == 1
    deadline = time.monotonic() + 5  # the server releases once its sends report completion
    while node.store.summary()["leases_active"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert node.store.summary()["leases_active"] == 0


def test_ucx_dead_peer_is_a_miss(setup) -> None:  # type: ignore[no-untyped-def]
    _node, server, transport = setup
    keys = block_hashes(NS, np.arange(16 * 2))
    data = np.random.default_rng(8).integers(0, 255, size=(2, BB), dtype=np.uint8)
    transport.write(server.address, NS_DIGEST, keys, data)
    address = server.address
    server.stop()
    out = np.zeros_like(data)
    result = transport.read(address, NS_DIGEST, [ReadItem(k) for k in keys], list(out))
    assert result.ok == 0 and address in result.reason
