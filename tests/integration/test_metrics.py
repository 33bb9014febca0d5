"""Prometheus ``/metrics`` of a real daemon, directory and router, scraped over HTTP and
parsed with prometheus_client's text parser; every value checked against what the test did
and against the daemon's own Stats (one set of counters: docs/metrics.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

import grpc
import numpy as np
from conftest import REPO_ROOT, free_port, start_daemon, writable_arena
from prometheus_client.parser import text_string_to_metric_families

from kvpool import KVSpec, PoolClient
from kvpool.core.hashing import pack_hashes
from kvpool.proto import pool_pb2, pool_pb2_grpc

SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
TOKENS = list(range(5000, 5000 + 16 * 6))  # 6 full blocks


def make_blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**16, size=(n, *SPEC.block_shape), dtype=np.uint16).view(np.float16)


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape, through the Prometheus parser."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def stats(address: str) -> dict[str, Any]:
    with grpc.insecure_channel(address) as channel:
        reply = pool_pb2_grpc.PoolStub(channel).Stats(pool_pb2.StatsRequest(), timeout=10)
    return dict(json.loads(reply.json))


def test_daemon_metrics_count_what_the_client_did() -> None:
    metrics_address = f"127.0.0.1:{free_port()}"
    daemon = start_daemon("--metrics-listen", metrics_address)
    try:
        with PoolClient.connect(daemon.address, SPEC) as client:
            hashes = client.hashes(TOKENS)
            assert client.put(hashes[:4], make_blocks(4, seed=1)).stored == 4
            assert client.put(hashes[:2], make_blocks(2, seed=1)).already_present == 2
            assert client.lookup(hashes) == 4  # 4 hits on host, 2 misses
            assert client.get(hashes[:3]).shape[0] == 3  # one read of 3 blocks
            assert client.remove(hashes[3:4]) == 1
        s = stats(daemon.address)
        m = scrape(metrics_address)
    finally:
        daemon.cleanup()
    assert value(m, "kvpool_put_blocks_total") == 4 == s["puts"]
    assert value(m, "kvpool_put_skipped_present_blocks_total") == 2
    assert value(m, "kvpool_put_commit_checked_blocks_total") == 1 == s["commit_checked_blocks"]  # 1 of 4 in 16
    assert value(m, "kvpool_put_bytes_total") == 4 * SPEC.block_bytes
    assert value(m, "kvpool_lookup_calls_total") == s["lookup_calls"] >= 1
    assert value(m, "kvpool_lookup_hit_blocks_total", tier="host") == s["lookup_hit_blocks_by_tier"]["host"]
    assert value(m, "kvpool_lookup_hit_blocks_total", tier="disk") == 0
    assert value(m, "kvpool_lookup_missed_blocks_total") == s["lookup_missed_blocks"]
    assert value(m, "kvpool_lookup_hit_tokens_total", tier="host") == 16 * s["lookup_hit_blocks_by_tier"]["host"]
    assert value(m, "kvpool_read_hit_blocks_total") == s["read_hit_blocks"] >= 3
    assert value(m, "kvpool_removed_blocks_total") == 1
    assert value(m, "kvpool_tier_blocks", tier="host") == 3 == s["blocks"]
    assert value(m, "kvpool_tier_used_bytes", tier="host") == s["used_bytes"] > 0
    assert value(m, "kvpool_tier_capacity_bytes", tier="host") == 64 << 20
    assert value(m, "kvpool_tier_evicted_blocks_total", tier="host") == 0
    assert value(m, "kvpool_tier_checksum_failures_total", tier="host") == 0
    assert value(m, "kvpool_leases_active") == s["leases_active"]
    assert value(m, "kvpool_namespaces") == 1
    assert value(m, "kvpool_event_seq") == s["last_event_seq"] >= 2  # stored, removed
    assert value(m, "kvpool_node_info", node_id=daemon.address, hash_scheme="kvpool-h1") == 1
    # latency histograms: every unary call the client made is one observation
    # (a same-host client sends them over the daemon's local socket: service "pool-local"; Hello over gRPC)
    assert value(m, "kvpool_rpc_duration_seconds_count", service="pool-local", method="PutStart", code="OK") == 2
    assert value(m, "kvpool_rpc_duration_seconds_count", service="pool", method="Hello", code="OK") == 1
    buckets = [v for (name, labels), v in m.items() if name == "kvpool_rpc_duration_seconds_bucket"
               and ("method", "PutStart") in labels]  # fmt: skip
    assert max(buckets) == 2  # cumulative: the +Inf bucket holds both
    assert value(m, "kvpool_rpc_in_flight", service="pool") == 0


def test_evictions_checksum_failures_and_error_codes_are_counted() -> None:
    metrics_address = f"127.0.0.1:{free_port()}"
    daemon = start_daemon("--metrics-listen", metrics_address, "--slab-bytes", "1MiB", capacity="1MiB")
    try:
        with PoolClient.connect(daemon.address, SPEC) as client:
            n = (1 << 20) // SPEC.block_bytes + 4  # more than fit: the oldest are evicted
            tokens = list(range(16 * n))
            hashes = client.hashes(tokens)
            for i in range(n):
                client.put(hashes[i : i + 1], make_blocks(1, seed=i))
            with grpc.insecure_channel(daemon.address) as channel:  # a block the daemon never saw: rot one
                stub = pool_pb2_grpc.PoolStub(channel)
                last = hashes[-1:]
                reply = stub.Lease(
                    pool_pb2.HashesRequest(namespace=client.namespace.digest(), hashes=pack_hashes(last)), timeout=10
                )
                stub.Release(pool_pb2.ReleaseRequest(lease_ids=[reply.lease_id]), timeout=10)
                writable_arena(client)[reply.offsets[0] + 7] ^= 0x33
                assert client.get(last).shape[0] == 0  # the reader sees the rot, reports it, it is dropped
                try:
                    stub.Lookup(pool_pb2.HashesRequest(namespace=b"\x01" * 16), timeout=10)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.NOT_FOUND or exc.code() == grpc.StatusCode.FAILED_PRECONDITION
        s = stats(daemon.address)
        m = scrape(metrics_address)
    finally:
        daemon.cleanup()
    evicted = value(m, "kvpool_tier_evicted_blocks_total", tier="host")
    assert evicted == s["evictions"] >= 4
    assert value(m, "kvpool_tier_checksum_failures_total", tier="host") == 1 == s["checksum_failures"]
    failed = [(labels, v) for (name, labels), v in m.items() if name == "kvpool_rpc_duration_seconds_count"
              and ("method", "Lookup") in labels and ("code", "OK") not in labels]  # fmt: skip
    assert len(failed) == 1 and failed[0][1] == 1  # the unknown namespace, under its status code


def test_metrics_port_in_use_is_one_clear_line_and_exit_1(tmp_path: Any) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "kvpool.cli.main", "serve", "--listen", f"127.0.0.1:{free_port()}",
             "--capacity-bytes", "16MiB", "--arena-dir", str(tmp_path), "--metrics-listen", f"127.0.0.1:{port}"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in done.stderr and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []  # the arena was removed on the way out


def test_a_metrics_listener_off_loopback_is_refused_without_insecure(tmp_path: Any) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "serve", "--listen", f"127.0.0.1:{free_port()}",
         "--arena-dir", str(tmp_path), "--metrics-listen", "0.0.0.0:9450"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "refusing to listen on 0.0.0.0:9450" in done.stderr


def test_directory_metrics_show_the_registered_node_and_its_blocks() -> None:
    dir_port, metrics_port = free_port(), free_port()
    directory = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "directory", "--listen", f"127.0.0.1:{dir_port}",
         "--metrics-listen", f"127.0.0.1:{metrics_port}"],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    daemon = None
    try:
        daemon = start_daemon("--directory", f"127.0.0.1:{dir_port}", "--node-id", "node-a")
        with PoolClient.connect(daemon.address, SPEC) as client:
            client.put(client.hashes(TOKENS)[:5], make_blocks(5, seed=3))
        m = wait_for(lambda s: s.get(("kvpool_directory_node_blocks", (("node", "node-a"),))) == 5,
                     f"127.0.0.1:{metrics_port}")  # fmt: skip
    finally:
        if daemon is not None:
            daemon.cleanup()
        directory.terminate()
        directory.wait(10)
    assert value(m, "kvpool_directory_leader") == 1
    assert value(m, "kvpool_directory_nodes") == 1
    assert value(m, "kvpool_directory_blocks") == 5
    assert value(m, "kvpool_directory_registrations_total") >= 1
    assert value(m, "kvpool_directory_node_capacity_bytes", node="node-a") == 64 << 20
    assert value(m, "kvpool_rpc_duration_seconds_count", service="directory", method="Register", code="OK") >= 1


def wait_for(condition: Any, address: str, timeout_s: float = 30.0) -> dict[Any, float]:
    """Scrape until ``condition(samples)`` holds (behaviour, not timing: the bound stops a hang)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            samples = scrape(address)
        except (urllib.error.URLError, ConnectionError):
            samples = {}
        if samples and condition(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics on {address} never satisfied the condition: {samples}")
        time.sleep(0.1)


def test_router_serves_metrics_on_its_http_listener() -> None:
    grpc_port, http_port = free_port(), free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "router", "--listen", f"127.0.0.1:{grpc_port}",
         "--http-listen", f"127.0.0.1:{http_port}", "--prefill", "2", "--decode", "1"],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        address = f"127.0.0.1:{http_port}"
        wait_for(lambda s: True, address)
        for _ in range(3):
            body = json.dumps({"hashes": ["ab" * 16] * 4, "output_tokens": 8}).encode()
            request = urllib.request.Request(f"http://{address}/route", data=body, method="POST")
            with urllib.request.urlopen(request, timeout=10) as reply:
                assert reply.status == 200
        m = scrape(address)
    finally:
        router.terminate()
        router.wait(10)
    assert value(m, "kvpool_router_decisions_total") == 3
    assert value(m, "kvpool_router_instances") == 3
    assert value(m, "kvpool_http_request_duration_seconds_count", path="/route", code="200") == 3
