"""The router daemon against a live pool daemon: blocks put through PoolClient show up
as expected hits (via the pool's KV event stream), removals take them away again.
Both daemons are real processes on 127.0.0.1, stopped by PID in teardown."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from conftest import free_port, start_daemon

from kvpool.client.pool_client import PoolClient
from kvpool.core.spec import KVSpec
from kvpool.proto import router_pb2, router_pb2_grpc

SPEC = KVSpec(model="router-live", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=16)


def _start(args: list[str], log_path: pathlib.Path) -> subprocess.Popen[bytes]:
    """The router's output goes to a file: an unread pipe would fill and stall its logging."""
    with log_path.open("wb") as log:
        return subprocess.Popen([sys.executable, "-m", "kvpool.cli.main", *args], stdout=log, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def _until(check: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if check():
                return True
        except Exception:
            pass
        time.sleep(0.1)
    return False


@pytest.fixture
def daemons(tmp_path: pathlib.Path) -> Iterator[tuple[str, str]]:
    pool = start_daemon("--slab-bytes", "1MiB", "--node-id", "pool-a")  # waits until it answers
    pool_addr = pool.address
    router_addr = f"127.0.0.1:{free_port()}"
    router = None
    try:
        router = _start(
            [
                "router",
                "--listen",
                router_addr,
                "--http-listen",
                "",
                "--prefill",
                "2",
                "--decode",
                "1",
                "--pool",
                pool_addr,
                "--spec",
                json.dumps(SPEC.to_dict()),
            ],
            tmp_path / "router.log",
        )
        yield pool_addr, router_addr
    finally:
        if router is not None:
            _stop(router)
        pool.cleanup()


def test_router_sees_blocks_put_through_the_pool(daemons: tuple[str, str]) -> None:
    pool_addr, router_addr = daemons
    channel = grpc.insecure_channel(router_addr)
    stub = router_pb2_grpc.RouterStub(channel)
    tokens = list(range(1000, 1000 + 4 * SPEC.block_tokens + 5))  # 4 full blocks + a partial one

    def route() -> router_pb2.RouteReply:
        return stub.Route(router_pb2.RouteRequest(token_ids=tokens, output_tokens=8), timeout=5)

    assert _until(lambda: route().expected_hit_blocks == 0), "router did not come up"
    with PoolClient.connect(pool_addr, SPEC) as client:
        hashes = client.hashes(np.array(tokens))
        assert len(hashes) == 4
        blocks = np.ones((3, *SPEC.block_shape), dtype=SPEC.numpy_dtype)
        client.put(hashes[:3], blocks)
        assert _until(lambda: route().expected_hit_blocks == 3), f"router never saw the put: {route()}"
        reply = route()
        assert not reply.rejected
        assert reply.prefill_instance.startswith("prefill-") and reply.decode_instance == "decode-0"
        assert reply.expected_hit_tokens == 3 * SPEC.block_tokens
        client.remove(hashes[:3])
        assert _until(lambda: route().expected_hit_blocks == 0), "router never saw the removal"
    stats = stub.Stats(router_pb2.StatsRequest(), timeout=5)
    assert stats.events_applied >= 2 and stats.resyncs >= 1 and stats.indexed_blocks == 0
    channel.close()
