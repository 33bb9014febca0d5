"""Disk faults through the real daemon: it says what is wrong and how to fix it, and keeps
serving from the host tier."""

from __future__ import annotations

import pathlib

import numpy as np
from conftest import start_daemon

from kvpool.client.pool_client import PoolClient
from kvpool.core.spec import KVSpec
from kvpool.storage.disk_tier import DiskTier

SPEC = KVSpec(model="fault-test", num_layers=1, num_kv_heads=1, head_dim=64, dtype="float32", block_tokens=16)
ARGS = ("--slab-bytes", "262144", "--disk-capacity-bytes", str(16 << 20), "--disk-slab-file-bytes", str(4 << 20))


def round_trip(address: str) -> None:
    with PoolClient.connect(address, SPEC) as client:
        blocks = np.random.default_rng(0).standard_normal((4, *SPEC.block_shape)).astype(np.float32)
        hashes = client.hashes(np.arange(4 * SPEC.block_tokens))
        assert client.put(hashes, blocks).stored == 4
        np.testing.assert_array_equal(client.get(hashes), blocks)


def test_disk_dir_that_is_a_file_keeps_the_daemon_serving(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "disk"
    blocker.write_bytes(b"not a directory")
    daemon = start_daemon(*ARGS, "--disk-dir", str(blocker), capacity="4MiB")
    try:
        round_trip(daemon.address)
        with PoolClient.connect(daemon.address, SPEC) as client:
            disk = client.stats()["tiers"]["disk"]
        assert disk["enabled"] is False and "--disk-dir" in disk["fault"]
        assert "disk tier disabled" in daemon.stderr()
    finally:
        daemon.cleanup()


def test_disk_dir_of_another_hash_scheme_is_refused_with_a_hint(tmp_path: pathlib.Path) -> None:
    DiskTier(str(tmp_path / "disk"), 16 << 20, 4 << 20, scheme="kvpool-h0").close()
    daemon = start_daemon(*ARGS, "--disk-dir", str(tmp_path / "disk"), capacity="4MiB")
    try:
        round_trip(daemon.address)
        with PoolClient.connect(daemon.address, SPEC) as client:
            disk = client.stats()["tiers"]["disk"]
        assert disk["enabled"] is False
        assert "kvpool-h0" in disk["fault"] and "empty --disk-dir" in disk["fault"]
    finally:
        daemon.cleanup()
