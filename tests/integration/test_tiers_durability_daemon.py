"""What survives a daemon's exit, through the real daemon (docs/tiers.md, "What survives"):

- SIGTERM with a disk tier: every acknowledged block is served after a restart on the same
  disk directory, byte for byte (the write-behind queue drains, then the shutdown flush
  writes the host-only blocks; the log says how many);
- SIGKILL: exactly the blocks the disk index had committed come back; blocks only in the
  host arena are gone (misses, never wrong bytes);
- a full filesystem (a real 24 MiB tmpfs, filled up under the running daemon): reported as
  "disk full" with the path and the free space, counted, and the host tier keeps serving.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator

import lmdb
import numpy as np
import pytest
from conftest import DaemonHandle, start_daemon

from kvpool.client.pool_client import PoolClient
from kvpool.core.spec import KVSpec

SPEC = KVSpec(model="durable", num_layers=1, num_kv_heads=1, head_dim=64, dtype="float32", block_tokens=16)
BLOCKS = 2000
# 12 MiB of host arena holds about 1,500 of the 2,000 8 KiB blocks: ~500 are demoted while
# putting, fewer than the write-behind queue holds, so no demotion can be dropped
DAEMON_ARGS = (
    "--slab-bytes", "262144",
    "--disk-capacity-bytes", str(64 << 20),
    "--disk-slab-file-bytes", str(8 << 20),
    "--write-behind-queue-blocks", "1024",
    "--log-level", "INFO",
)  # fmt: skip
HOST = "12MiB"


def block_for(i: int) -> np.ndarray:
    return np.random.default_rng(7_000_003 + i).standard_normal(SPEC.block_shape).astype(np.float32)


def put_all(client: PoolClient, n: int, first: int = 0) -> dict[bytes, int]:
    """Put blocks ``first..first+n`` in batches; returns the acknowledged ones (hash -> i)."""
    acked: dict[bytes, int] = {}
    for start in range(first, first + n, 50):
        ids = list(range(start, min(start + 50, first + n)))
        hashes = [client.hashes(np.arange(16, dtype=np.int64) + i * 16)[0] for i in ids]
        result = client.put(hashes, np.stack([block_for(i) for i in ids]))
        assert result.stored + result.already_present == len(ids), result
        acked.update(zip(hashes, ids))
    return acked


def served(client: PoolClient, acked: dict[bytes, int], keys: list[bytes]) -> set[bytes]:
    """The keys the daemon serves, each verified against the bytes that were put."""
    out: set[bytes] = set()
    for h in keys:
        got = client.get([h])
        if got.shape[0]:
            np.testing.assert_array_equal(got[0], block_for(acked[h]))
            out.add(h)
    return out


def wait_recovered(client: PoolClient) -> dict[str, object]:
    deadline = time.monotonic() + 30
    while (disk := client.stats()["tiers"]["disk"])["recovering"] and time.monotonic() < deadline:
        time.sleep(0.02)  # the index loads in the background
    return dict(disk)


def committed_keys(disk_dir: pathlib.Path) -> set[bytes]:
    env = lmdb.open(str(disk_dir / "index.lmdb"), max_dbs=2, readonly=True, lock=False)
    try:
        db = env.open_db(b"blocks", create=False)
        with env.begin(db=db) as txn:
            return {bytes(k)[16:] for k, _ in txn.cursor()}  # keys are namespace digest || hash
    finally:
        env.close()


def restarted(disk_dir: pathlib.Path) -> DaemonHandle:
    return start_daemon(*DAEMON_ARGS, "--disk-dir", str(disk_dir), capacity=HOST)


@pytest.mark.slow
def test_sigterm_writes_every_acknowledged_block_to_disk(tmp_path: pathlib.Path) -> None:
    disk_dir = tmp_path / "disk"
    daemon = restarted(disk_dir)
    try:
        with PoolClient.connect(daemon.address, SPEC) as client:
            acked = put_all(client, BLOCKS)
            host = client.stats()["tiers"]["host"]
            assert host["demotions"] > 0 and host["demotion_drops"] == 0
        assert daemon.stop(timeout_s=60) == 0  # SIGTERM
        log = daemon.stderr()
    finally:
        daemon.cleanup()
    assert len(acked) == BLOCKS
    flush_line = next(line for line in log.splitlines() if "shutdown flush to" in line)
    assert " 0 not written" in flush_line, flush_line
    print("\n" + flush_line)
    assert committed_keys(disk_dir) == set(acked)

    daemon = restarted(disk_dir)
    try:
        with PoolClient.connect(daemon.address, SPEC) as client:
            assert wait_recovered(client)["recovered_blocks"] == BLOCKS
            assert served(client, acked, list(acked)) == set(acked)  # every one, byte for byte
    finally:
        daemon.cleanup()


@pytest.mark.slow
def test_sigkill_keeps_exactly_what_the_disk_index_committed(tmp_path: pathlib.Path) -> None:
    disk_dir = tmp_path / "disk"
    daemon = restarted(disk_dir)
    try:
        with PoolClient.connect(daemon.address, SPEC) as client:
            acked = put_all(client, BLOCKS)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # let the write-behind queue drain
                stats = client.stats()["tiers"]
                if stats["disk"]["queued_blocks"] == 0 and stats["disk"]["writes"] == stats["host"]["demotions"]:
                    break
                time.sleep(0.02)
            demoted = stats["host"]["demotions"]
        daemon.kill()  # SIGKILL: no shutdown flush
    finally:
        daemon.cleanup()
    committed = committed_keys(disk_dir)
    assert len(committed) == demoted > 0 and committed < set(acked)

    daemon = restarted(disk_dir)
    try:
        with PoolClient.connect(daemon.address, SPEC) as client:
            wait_recovered(client)
            # the docs' promise: committed disk blocks survive; host-only blocks are gone
            assert served(client, acked, list(acked)) == committed
    finally:
        daemon.cleanup()


@contextlib.contextmanager
def small_tmpfs(where: pathlib.Path, size_mib: int) -> Iterator[pathlib.Path]:
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(where)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); "
            "tests/unit/test_tiers_durability.py injects ENOSPC at the write call instead"
        )
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(path: pathlib.Path) -> int:
    """Write zeros into ``path`` until the filesystem is full; bytes written."""
    written = 0
    chunk = b"\0" * (256 << 10)
    with path.open("wb", buffering=0) as fh:
        while True:
            try:
                written += fh.write(chunk) or 0
            except OSError:
                return written


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="mounting a tmpfs needs root on Linux")
def test_a_full_filesystem_is_reported_as_disk_full_and_the_host_keeps_serving(tmp_path: pathlib.Path) -> None:
    with small_tmpfs(tmp_path / "small", 24) as mnt:
        disk_dir = mnt / "disk"
        args = (*DAEMON_ARGS[:-2], "--disk-capacity-bytes", str(64 << 20), "--disk-dir", str(disk_dir))
        daemon = start_daemon(*args, capacity="4MiB")
        try:
            with PoolClient.connect(daemon.address, SPEC) as client:
                acked = put_all(client, 1500)  # ~1,000 demoted: slab files 0 and 1 (16 MiB) in use
                assert client.stats()["tiers"]["disk"]  # and the tier is up
                deadline = time.monotonic() + 30
                while client.stats()["tiers"]["disk"]["queued_blocks"] and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert fill(mnt / "filler") > 0  # someone else fills the filesystem
                acked.update(put_all(client, 1500, first=1500))  # demotions now meet a full disk
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    disk = client.stats()["tiers"]["disk"]
                    if disk["disk_full"] and not disk["queued_blocks"]:
                        break
                    time.sleep(0.05)
                assert disk["disk_full"] >= 1, disk
                fault = next(f for f in disk["faults"] if "disk full" in f)
                assert str(mnt) in fault and "bytes free" in fault and "dmesg" not in fault, fault
                # the host tier keeps serving: every block it holds reads back verified, and
                # puts still succeed
                in_host = int(client.stats()["blocks"])  # the newest blocks are the host's
                assert in_host > 100
                host_keys = [h for h in acked if acked[h] >= 3000 - in_host // 2]
                assert served(client, acked, host_keys) == set(host_keys)
                assert put_all(client, 50, first=9000)
                shown = subprocess.run(
                    [sys.executable, "-m", "kvpool.cli.main", "inspect", "stats", "--address", daemon.address],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                assert "disk_full=" in shown and "queue_full_drops=" in shown
            daemon.stop(timeout_s=60)
            log = daemon.stderr()
        finally:
            daemon.cleanup()
        full_lines = [line for line in log.splitlines() if "disk full" in line]
        assert full_lines and all("dmesg" not in line and str(mnt) in line for line in full_lines)
        print("\n" + full_lines[0])
