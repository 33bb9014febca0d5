"""The router daemon against a live pool daemon: blocks put through PoolClient show up
as expected hits (via the pool's KV event stream), removals take them away again.
Both daemons are real processes on 127.0.0.1, stopped by PID in teardown."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from kvpool.client.pool_client import PoolClient
from kvpool.core.spec import KVSpec
from kvpool.proto import router_pb2, router_pb2_grpc

SPEC = KVSpec(model="router-live", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=16)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


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


def _can_connect(addr: str) -> bool:
    PoolClient.connect(addr, SPEC).close()
    return True


@pytest.fixture
def daemons(tmp_path) -> Iterator[tuple[str, str]]:  # type: ignore[no-untyped-def]
    pool_addr = f"127.0.0.1:{_free_port()}"
    router_addr = f"127.0.0.1:{_free_port()}"
    pool = _start(
        ["serve", "--listen", pool_addr, "--capacity-bytes", "64MiB", "--slab-bytes", "1MiB", "--node-id", "pool-a"]
    )
    router = None
    try:
        assert _until(lambda: _can_connect(pool_addr)), "pool daemon did not start"
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
            ]
        )
        yield pool_addr, router_addr
    finally:
        if router is not None:
            _stop(router)
        _stop(pool)


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
