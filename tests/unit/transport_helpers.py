"""Shared fixtures and data for the data-plane tests (TCP, resilience, review findings): one
tiny spec and namespace, a real PoolNode arena, its TCP data server and a TCP transport.
Test modules import what they use; pytest picks the imported fixtures up by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.core.clock import Clock, MonotonicClock
from kvpool.core.config import DaemonConfig, StoreConfig
from kvpool.core.hashing import HASH_SCHEME, block_hashes
from kvpool.core.spec import KVSpec, Namespace
from kvpool.daemon.cluster_node import NodeBlockStore
from kvpool.daemon.node import PoolNode
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_server import TcpDataServer

SPEC = KVSpec(model="tiny", num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=8)
NS = Namespace(SPEC, b"tenant")
NS_DIGEST = NS.digest()
BB = SPEC.block_bytes


def make_node(tmp_path: Path, clock: Clock | None = None, max_leases: int = 100_000) -> PoolNode:
    """A PoolNode with a 4 MiB arena under ``tmp_path``, ``NS`` registered."""
    store = StoreConfig(capacity_bytes=4 << 20, slab_bytes=64 << 10, max_leases=max_leases)
    node = PoolNode(DaemonConfig(arena_dir=str(tmp_path), store=store), clock or MonotonicClock())
    node.register(HASH_SCHEME, SPEC, NS_DIGEST, SPEC.digest())
    return node


def keys(n: int, start: int = 0) -> list[bytes]:
    """Hashes of ``n`` consecutive blocks of ``NS``, from block ``start`` on."""
    return block_hashes(NS, np.arange(start * 8, (start + n) * 8))


def blocks(n: int, seed: int) -> np.ndarray:
    """``n`` rows of ``BB`` random bytes."""
    return np.random.default_rng(seed).integers(0, 255, size=(n, BB), dtype=np.uint8)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[PoolNode]:
    pool_node = make_node(tmp_path)
    yield pool_node
    pool_node.close()


@pytest.fixture
def server(node: PoolNode) -> Iterator[TcpDataServer]:
    srv = TcpDataServer(NodeBlockStore(node), "127.0.0.1:0")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(params=[True, False], ids=["native-receive", "python-receive"])
def transport(request: pytest.FixtureRequest) -> Iterator[TcpTransport]:
    """Both receive paths: rows hashed as they land (C) and ``recv_into`` + a checksum per row."""
    t = TcpTransport(timeout_s=2.0, native_receive=request.param)
    yield t
    t.close()
