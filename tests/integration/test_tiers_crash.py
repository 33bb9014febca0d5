"""Crash safety of the disk tier through the real daemon: SIGKILL in the middle of disk
writes, restart on the same disk directory, and every block the disk index had committed
comes back byte for byte (nothing else that comes back is wrong either)."""

from __future__ import annotations

import pathlib
import threading
import time

import lmdb
import numpy as np
import pytest
from conftest import start_daemon

from kvpool.client.pool_client import PoolClient
from kvpool.core.spec import KVSpec

SPEC = KVSpec(model="crash-test", num_layers=1, num_kv_heads=1, head_dim=64, dtype="float32", block_tokens=16)
DAEMON_ARGS = (
    "--slab-bytes", "262144",
    "--disk-capacity-bytes", str(64 << 20),
    "--disk-slab-file-bytes", str(8 << 20),
    "--write-behind-queue-blocks", "256",
)  # fmt: skip


def block_for(i: int) -> np.ndarray:
    """Deterministic bytes of block ``i`` (so the test knows what every key must hold)."""
    rng = np.random.default_rng(1_000_003 + i)
    return rng.standard_normal(SPEC.block_shape).astype(np.float32)


def hash_for(client: PoolClient, i: int) -> bytes:
    tokens = np.arange(SPEC.block_tokens, dtype=np.int64) + i * SPEC.block_tokens
    return client.hashes(tokens)[0]


def committed_keys(disk_dir: pathlib.Path) -> set[bytes]:
    """Block hashes the disk index committed, read straight from LMDB (not through the tier).
    Its keys are namespace digest || hash; this test writes one namespace."""
    env = lmdb.open(str(disk_dir / "index.lmdb"), max_dbs=2, readonly=True, lock=False)
    try:
        db = env.open_db(b"blocks", create=False)
        with env.begin(db=db) as txn:
            keys = [bytes(k) for k, _ in txn.cursor()]
        assert all(len(k) == 32 for k in keys) and len({k[:16] for k in keys}) <= 1
        return {k[16:] for k in keys}
    finally:
        env.close()


@pytest.mark.slow
def test_sigkill_mid_disk_writes_loses_no_committed_block(tmp_path: pathlib.Path) -> None:
    disk_dir = tmp_path / "disk"
    args = (*DAEMON_ARGS, "--disk-dir", str(disk_dir))
    daemon = start_daemon(*args, capacity="1MiB")
    expected: dict[bytes, int] = {}
    stop = threading.Event()
    writer_error: list[BaseException] = []
    try:
        client = PoolClient.connect(daemon.address, SPEC)

        def keep_putting() -> None:
            i = 0
            try:
                while not stop.is_set():
                    batch = list(range(i, i + 16))
                    hashes = [hash_for(client, j) for j in batch]
                    for h, j in zip(hashes, batch):
                        expected[h] = j
                    client.put(hashes, np.stack([block_for(j) for j in batch]))
                    i += 16
            except BaseException as exc:  # the daemon dying under us is expected
                if not stop.is_set():
                    writer_error.append(exc)

        thread = threading.Thread(target=keep_putting, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            disk = client.stats()["tiers"]["disk"]
            if disk["writes"] >= 400 and disk["queued_blocks"] + len(expected) > disk["writes"]:
                break
            time.sleep(0.02)
        assert not writer_error, writer_error
        stop.set()
        daemon.kill()  # SIGKILL while the writer thread is still putting and demoting
        thread.join(10)
        client.close()
    finally:
        daemon.cleanup()

    committed = committed_keys(disk_dir)
    assert len(committed) >= 400
    assert committed <= set(expected)
    assert len(expected) > len(committed)  # the kill did land with blocks not yet on disk

    daemon = start_daemon(*args, capacity="1MiB")
    try:
        with PoolClient.connect(daemon.address, SPEC) as client:
            deadline = time.monotonic() + 30
            while (stats := client.stats()["tiers"]["disk"])["recovering"] and time.monotonic() < deadline:
                time.sleep(0.02)  # the index loads in the background; reads are served meanwhile
            assert stats["recovered_blocks"] == len(committed)
            keys = sorted(committed)
            for start in range(0, len(keys), 32):
                chunk = keys[start : start + 32]
                got = client.get(chunk)
                assert got.shape[0] == len(chunk), "a committed block did not come back"
                for h, row in zip(chunk, got):
                    np.testing.assert_array_equal(row, block_for(expected[h]))
            # blocks that were only in the old host arena or the write queue are misses,
            # never wrong bytes
            others = [h for h in expected if h not in committed][:200]
            for h in others:
                got = client.get([h])
                if got.shape[0]:
                    np.testing.assert_array_equal(got[0], block_for(expected[h]))
            assert client.stats()["tiers"]["disk"]["checksum_failures"] == 0
    finally:
        daemon.cleanup()
