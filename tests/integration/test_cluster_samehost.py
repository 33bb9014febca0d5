"""Nodes on one host (no etcd): a client reads another same-host node's blocks through
that node's shared-memory arena instead of the data plane; pins and removes sent to the
directory reach the holders; a node that stops heartbeating is dropped."""

from __future__ import annotations

import json

import numpy as np

from kvpool.client.cluster_client import ClusterClient
from kvpool.core.spec import KVSpec
from kvpool.daemon.cluster_local import LocalCluster, eventually
from kvpool.proto import directory_pb2

SPEC = KVSpec(model="tiny", num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)


def test_same_host_reads_map_the_other_nodes_arena(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with LocalCluster(str(tmp_path)) as cluster:
        d = cluster.start_directory(etcd=False, node_ttl_ms=1500)
        a = cluster.start_node("node-a", [d.address], etcd=False, host="host-1")
        b = cluster.start_node("node-b", [d.address], etcd=False, host="host-1")
        data = np.random.default_rng(0).integers(0, 1 << 15, size=(10, *SPEC.block_shape)).astype(np.float16)
        with (
            ClusterClient.connect(SPEC, directory=[d.address], local=a.address) as ca,
            ClusterClient.connect(SPEC, directory=[d.address], local=b.address) as cb,
        ):
            h = ca.hashes(np.arange(16 * 10))
            assert ca.put(h, data).stored == 10
            assert eventually(lambda: cb.lookup(h) == 10)
            out = np.zeros_like(data)
            assert cb.get_into(h, out) == 10
            np.testing.assert_array_equal(out, data)
            assert cb.counters["same_host_blocks"] == 10 and cb.counters["remote_blocks"] == 0
            # pins go to the holder node through the directory
            assert cb.pin(h[:3], ttl_ms=60_000) == 3
            assert cb.unpin(h[:3]) == 3
            assert cb.pin(h[:2]) == 2  # hard pin
            stats = json.loads(cb.link.call("Stats", directory_pb2.StatsRequest()).json)
            assert stats["etcd"].startswith("not configured")
            # without etcd, liveness is the heartbeat: a SIGKILLed node is dropped after node_ttl_ms
            a.kill()
            assert eventually(lambda: cb.lookup(h) == 0, timeout_s=8)
            assert cb.get_into(h, out) == 0


def test_taken_data_port_fails_the_start_cleanly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import socket
    import subprocess
    import sys

    from kvpool.daemon.cluster_local import free_port

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvpool.cli.main",
                "serve",
                "--listen",
                f"127.0.0.1:{free_port()}",
                "--data-listen",
                f"127.0.0.1:{port}",
                "--capacity-bytes",
                "64MiB",
                "--arena-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert "data plane cannot listen" in result.stderr and "--data-listen" in result.stderr
    assert not list(tmp_path.glob("*.arena"))  # the node shut down whole: its arena is gone


def test_the_data_plane_listens_once_the_daemon_answers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A daemon that answers a Stats call has every listener up: its data plane accepts a
    connection at once (it used to bind after the gRPC server started, and a client handed
    the data address right after start-up was refused now and then: seen in CI, in
    test_cluster_fairness). The old order passed this test in most runs; it fails when
    that race shows."""
    import socket

    from conftest import free_port, start_daemon

    for _ in range(3):
        data_address = f"127.0.0.1:{free_port()}"
        daemon = start_daemon("--data-listen", data_address, capacity="64MiB")
        try:
            host, port = data_address.rsplit(":", 1)
            socket.create_connection((host, int(port)), timeout=5.0).close()  # no retry, no wait
        finally:
            daemon.cleanup()
