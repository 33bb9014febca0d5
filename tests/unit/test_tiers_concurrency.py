"""Many threads through the tiered store at once (as the daemon's gRPC workers do): no
deadlock between the host lock, the disk writer and promotions, and no wrong bytes."""

from __future__ import annotations

import pathlib
import threading

import numpy as np

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig, TierConfig
from kvpool.core.errors import CapacityExhausted
from kvpool.storage.tiered_store import TieredStore

BLOCK = 4096
NS = bytes(16)
HOST = StoreConfig(capacity_bytes=1 << 18, slab_bytes=1 << 16)  # 64 blocks
KEYS = 400


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


DATA = [np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8) for i in range(KEYS)]
SUMS = [checksum64(d) for d in DATA]


def test_threads_putting_and_reading_through_all_tiers(tmp_path: pathlib.Path) -> None:
    buffer = np.zeros(HOST.capacity_bytes, np.uint8)
    tiers = TierConfig(
        disk_dir=str(tmp_path),
        disk_capacity_bytes=1 << 21,
        disk_slab_file_bytes=1 << 20,
        disk_io_threads=2,
        write_behind_queue_blocks=32,
        disk_policy="s3fifo",
        host_policy="s3fifo",
    )
    store = TieredStore(buffer, HOST, tiers, FakeClock())
    errors: list[BaseException] = []
    served = [0]
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                first = int(rng.integers(0, KEYS - 4))
                ids = list(range(first, first + int(rng.integers(1, 5))))
                if rng.random() < 0.5:
                    try:
                        grant = store.put_start(NS, [key(i) for i in ids], BLOCK)
                    except CapacityExhausted:
                        continue
                    for index, offset in grant.slots:
                        buffer[offset : offset + BLOCK] = DATA[ids[index]]
                    if grant.put_id:
                        store.put_commit(grant.put_id, [SUMS[ids[index]] for index, _ in grant.slots])
                else:
                    lease = store.lease([key(i) for i in ids])
                    for i, loc in zip(ids, lease.locations):
                        assert checksum64(buffer[loc.offset : loc.offset + loc.size]) == SUMS[i]
                    with lock:
                        served[0] += len(lease.locations)
                    if lease.lease_id:
                        store.release(lease.lease_id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not any(t.is_alive() for t in threads), "a worker is stuck (deadlock?)"
        assert not errors, errors
        assert store.flush(10)
        s = store.summary()
        assert served[0] > 0 and s["tiers"]["host"]["demotions"] > 0 and s["tiers"]["host"]["promotions"] > 0
        assert s["tiers"]["disk"]["checksum_failures"] == 0 and s["used_bytes"] <= HOST.capacity_bytes
    finally:
        store.close()
