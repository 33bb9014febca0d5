"""``kvpool cluster up`` / ``status`` / ``down`` as a user runs them: real processes on loopback.

Each test checks the end state a user cares about: the pool served a put/get, and after
the stop no process of the cluster is alive and no shared-memory arena file is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_auth import _self_signed

from kvpool.client import PoolClient
from kvpool.client.cluster_client import ClusterClient
from kvpool.core.errors import Unavailable
from kvpool.core.spec import KVSpec
from kvpool.daemon.launcher import etcd_binary, eventually
from kvpool.daemon.supervise import same_process_alive

SPEC = KVSpec(model="tiny", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=16)
CLI = [sys.executable, "-m", "kvpool.cli.main", "cluster"]


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *SPEC.block_shape)).astype(np.float16)


def cli(*args: str, env: dict[str, str] | None = None, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})}
    )


def start_foreground(workdir: Path, *args: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [*CLI, "up", "--json", "--workdir", str(workdir), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the addresses, once everything answers
    assert line, proc.stderr.read() if proc.stderr else ""
    return proc, json.loads(line)


def recorded(workdir: Path) -> list[dict[str, Any]]:
    return list(json.loads((workdir / "cluster.json").read_text())["procs"])


def assert_all_gone(procs: list[dict[str, Any]]) -> None:
    assert procs
    assert eventually(lambda: not any(same_process_alive(p["pid"], p["start_ticks"]) for p in procs), 20)
    for p in procs:
        if p.get("arena_path"):
            assert not os.path.exists(p["arena_path"]), p


def put_get_one_node(address: str) -> None:
    data = blocks(3, seed=1)
    with PoolClient.connect(address, SPEC, salt=b"up") as c:
        hashes = c.hashes(list(range(16 * 3)))
        assert c.put(hashes, data).stored == 3
        out = np.zeros_like(data)
        assert c.get_into(hashes, out) == 3
    np.testing.assert_array_equal(out, data)


@pytest.mark.slow
def test_up_one_node_serves_and_ctrl_c_leaves_nothing(tmp_path: Path) -> None:
    proc, info = start_foreground(tmp_path)
    procs = recorded(tmp_path)
    try:
        assert info["etcd"] == "" and info["directory"] == "" and len(info["nodes"]) == 1
        assert [p["name"] for p in procs] == ["node-0"]  # embedded: one process, no etcd
        put_get_one_node(info["nodes"][0])
        status = json.loads(cli("status", "--json", "--workdir", str(tmp_path)).stdout)
        assert status["up"] and status["processes"][0]["alive"]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    assert_all_gone(procs)
    assert not (tmp_path / "cluster.json").exists()


@pytest.mark.slow
def test_a_crashed_node_is_reported_and_the_supervisor_exits(tmp_path: Path) -> None:
    proc, _ = start_foreground(tmp_path)
    procs = recorded(tmp_path)
    os.kill(procs[0]["pid"], signal.SIGKILL)
    assert proc.wait(60) == 1
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert "node-0" in err and "exited with status -9" in err
    assert_all_gone(procs)  # its arena too: a SIGKILLed node cannot remove it itself


def test_more_than_one_node_without_etcd_says_so(tmp_path: Path) -> None:
    result = cli("up", "--nodes", "2", "--workdir", str(tmp_path), env={"PATH": str(tmp_path)})
    assert result.returncode == 1
    assert "etcd is not installed" in result.stderr and "apt-get install etcd-server" in result.stderr


@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.skipif(etcd_binary() is None, reason="etcd binary not installed (apt-get install etcd-server)")
def test_three_nodes_in_the_background_then_status_and_down(tmp_path: Path) -> None:
    up = cli("up", "--background", "--nodes", "3", "--json", "--workdir", str(tmp_path))
    assert up.returncode == 0, up.stderr
    info = json.loads(up.stdout)
    procs = recorded(tmp_path)
    try:
        assert [p["name"] for p in procs] == ["etcd", "directory", "node-0", "node-1", "node-2"]
        assert len(info["nodes"]) == 3 and info["directory"] and info["etcd"]
        again = cli("up", "--background", "--workdir", str(tmp_path))
        assert again.returncode == 1 and "already running" in again.stderr
        data = blocks(4, seed=2)
        with ClusterClient.connect(
            SPEC, salt=b"up", directory=[info["directory"]], local=info["nodes"][0], timeout_s=5.0
        ) as c:
            hashes = c.hashes(np.arange(16 * 4))
            c.put(hashes, data)
            out = np.zeros_like(data)
            assert eventually(lambda: c.get_into(hashes, out) == 4)
        np.testing.assert_array_equal(out, data)
        status = cli("status", "--workdir", str(tmp_path))
        assert status.returncode == 0 and status.stdout.count("alive") == 5
    finally:
        down = cli("down", "--workdir", str(tmp_path))
    assert down.returncode == 0, down.stderr
    assert "SIGKILL" not in down.stdout  # the supervisor stopped its children itself
    assert_all_gone(procs)
    assert cli("status", "--workdir", str(tmp_path)).returncode == 1


@pytest.mark.slow
@pytest.mark.skipif(etcd_binary() is None or shutil.which("openssl") is None, reason="needs etcd and openssl")
def test_three_nodes_with_tls_in_the_background(tmp_path: Path) -> None:
    """``--tls-cert-file`` / ``--tls-key-file``: the directory and every node serve TLS (nodes
    dial the directory over TLS); a client with the CA reads and writes, one without gets
    nothing from the directory."""
    cert, key = _self_signed(str(tmp_path))
    root = Path(cert).read_bytes()
    workdir = tmp_path / "cluster"
    up = cli("up", "--background", "--nodes", "3", "--json", "--workdir", str(workdir),
             "--tls-cert-file", cert, "--tls-key-file", key)  # fmt: skip
    assert up.returncode == 0, up.stderr
    info = json.loads(up.stdout)
    procs = recorded(workdir)
    try:
        data = blocks(4, seed=3)
        connect: dict[str, Any] = {"directory": [info["directory"]], "timeout_s": 5.0, "tls_root_certs": root}
        with (
            ClusterClient.connect(SPEC, b"up", local=info["nodes"][0], directory_tls_root_certs=root, **connect) as c,
            ClusterClient.connect(SPEC, b"up", local=info["nodes"][2], directory_tls_root_certs=root, **connect) as r,
        ):
            hashes = c.hashes(np.arange(16 * 4))
            assert c.put(hashes, data).stored == 4
            out = np.zeros_like(data)
            assert eventually(lambda: r.get_into(hashes, out) == 4)  # node-2's client reads node-0 over TLS
        np.testing.assert_array_equal(out, data)
        with pytest.raises(Unavailable):  # plaintext to the TLS directory
            ClusterClient.connect(SPEC, b"up", local="", failover_wait_ms=0, **{**connect, "tls_root_certs": None})
    finally:
        down = cli("down", "--workdir", str(workdir))
    assert down.returncode == 0, down.stderr
    assert_all_gone(procs)
