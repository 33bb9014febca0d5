"""A real ``kvpool serve`` refuses an arena the machine cannot hold, instead of letting a
client die with SIGBUS later; ``--allow-overcommit`` is the explicit way round it.

The small-filesystem cases mount an 8 MiB tmpfs for the arena directory (needs root and
CAP_SYS_ADMIN; skipped with the reason otherwise).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import PYTHON, REPO_ROOT, free_port, start_daemon

from kvpool.client.pool_client import PoolClient
from kvpool.core.errors import CapacityExhausted
from kvpool.core.spec import KVSpec
from kvpool.storage.arena import _reserve

# 512 KiB blocks, 1 MiB slabs: an 8 MiB filesystem holds 16 of them at most
SPEC = KVSpec(model="arena-cap", num_layers=4, num_kv_heads=4, head_dim=128, dtype="float16", block_tokens=64)
SLAB = ("--slab-bytes", "1MiB")
TMPFS_BYTES = 8 << 20


def serve_until_exit(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``kvpool serve`` expecting it to exit at start; its exit code and stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    argv = [PYTHON, "-m", "kvpool.cli.main", "serve", "--listen", f"127.0.0.1:{free_port()}", *args]
    return subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture
def tiny_tmpfs(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(mount_point)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root + CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_one_tib_arena_is_refused_at_start_with_the_numbers(tmp_path: pathlib.Path) -> None:
    done = serve_until_exit("--capacity-bytes", "1TiB", "--arena-dir", str(tmp_path))
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr  # one clear line, no traceback
    line = lines[0]
    assert "CAPACITY_EXHAUSTED" in line and "1099511627776 bytes (1.00 TiB)" in line
    assert "MemAvailable" in line and "--capacity-bytes" in line and "--allow-overcommit" in line
    assert list(tmp_path.glob("*.arena")) == []


def test_arena_larger_than_its_filesystem_is_refused_not_sigbus(tiny_tmpfs: pathlib.Path) -> None:
    done = serve_until_exit("--capacity-bytes", "16MiB", *SLAB, "--arena-dir", str(tiny_tmpfs))
    assert done.returncode == 1, done.stderr
    assert f"free space of {tiny_tmpfs}" in done.stderr and "16777216 bytes" in done.stderr
    assert list(tiny_tmpfs.glob("*.arena")) == []


def test_a_reserved_arena_fills_to_the_last_slot_without_sigbus(tiny_tmpfs: pathlib.Path) -> None:
    """6 MiB on the 8 MiB tmpfs fits: every page is reserved, so a client may write all of it;
    a second daemon on the same filesystem is then refused (the room is taken), not a SIGBUS."""
    daemon = start_daemon(*SLAB, "--arena-dir", str(tiny_tmpfs), "--high-watermark", "1.0", capacity="6MiB")
    try:
        (arena,) = tiny_tmpfs.glob("*.arena")
        assert arena.stat().st_blocks * 512 >= 6 << 20
        blocks = np.random.default_rng(0).standard_normal((12, *SPEC.block_shape)).astype(np.float16)
        with PoolClient.connect(daemon.address, SPEC) as client:
            hashes = client.hashes(np.arange(12 * SPEC.block_tokens))
            assert client.put(hashes, blocks).stored == 12  # 12 x 512 KiB = the whole arena
            np.testing.assert_array_equal(client.get(hashes), blocks)
        second = serve_until_exit("--capacity-bytes", "6MiB", *SLAB, "--arena-dir", str(tiny_tmpfs))
        assert second.returncode == 1 and "CAPACITY_EXHAUSTED" in second.stderr, second.stderr
    finally:
        daemon.cleanup()


CLIENT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from kvpool.client.pool_client import PoolClient
    from kvpool.core.spec import KVSpec
    spec = KVSpec(model="arena-cap", num_layers=4, num_kv_heads=4, head_dim=128, dtype="float16", block_tokens=64)
    with PoolClient.connect(sys.argv[1], spec) as client:
        for i in range(28):
            block = np.full((1, *spec.block_shape), i, dtype=np.float16)
            client.put(client.hashes(np.arange(spec.block_tokens) + i * 100_000), block)
    print("all puts returned")
    """
)


def test_allow_overcommit_starts_with_a_warning_and_the_risk_is_real(tiny_tmpfs: pathlib.Path) -> None:
    """The override does what it says: the daemon starts, says why that is unsafe, and a client
    writing more than the filesystem holds dies with SIGBUS (the failure the refusal prevents)."""
    daemon = start_daemon(*SLAB, "--arena-dir", str(tiny_tmpfs), "--allow-overcommit", capacity="16MiB")
    try:
        stderr = daemon.stderr()
        assert "WARNING" in stderr and "--allow-overcommit" in stderr and "SIGBUS" in stderr
        done = subprocess.run(
            [sys.executable, "-c", CLIENT, daemon.address], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == -signal.SIGBUS, (done.returncode, done.stdout, done.stderr[-2000:])
        assert daemon.proc.poll() is None  # the daemon itself is still up
    finally:
        daemon.cleanup()


def test_a_reservation_that_loses_a_race_is_the_same_typed_refusal(tiny_tmpfs: pathlib.Path) -> None:
    """Another process may take the room between the check and ``posix_fallocate``: ENOSPC
    then reads as CAPACITY_EXHAUSTED with the free space at that moment, not an OSError."""
    path = tiny_tmpfs / "raced.arena"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(CapacityExhausted, match="cannot reserve an arena of 16777216 bytes") as info:
            _reserve(fd, str(path), 16 << 20)
        assert "free now" in info.value.message and "--allow-overcommit" in info.value.hint
    finally:
        os.close(fd)
        path.unlink()
