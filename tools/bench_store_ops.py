"""Python function calls per store operation, a figure the machine's load does not change:
lease + release of 16 blocks and put_start + write + put_commit of 16 blocks, on a
``HostStore``, a ``TieredStore`` with a disk tier and one with a (cpu) device tier.

    python tools/bench_store_ops.py

Debug invariants are off here, as in production (``kvpool/core/invariants.py``): the
figure shows what the hot path costs without them (docs/tiers.md, "Debug invariants").
"""

from __future__ import annotations

import cProfile
import pstats
import tempfile
from collections.abc import Callable

import numpy as np

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig, TierConfig
from kvpool.storage.host_store import HostStore
from kvpool.storage.tiered_store import TieredStore

BLOCK = 4096
BATCH = 16
ROUNDS = 50
CONFIG = StoreConfig(capacity_bytes=64 << 20, slab_bytes=1 << 20)


def keys(n: int, base: int = 0) -> list[bytes]:
    return [(base + i).to_bytes(32, "little") for i in range(n)]


def calls(fn: Callable[[], None]) -> int:
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    return int(pstats.Stats(profile).total_calls)  # type: ignore[attr-defined]


def measure(store: HostStore | TieredStore, buffer: np.ndarray, label: str) -> None:
    data = np.ones(BLOCK, np.uint8)
    checksum = checksum64(data)

    def put(base: int) -> None:
        grant = store.put_start(b"n" * 16, keys(BATCH, base), BLOCK)
        for _, offset in grant.slots:
            buffer[offset : offset + BLOCK] = data
        store.put_commit(grant.put_id, [checksum] * len(grant.slots))

    put(0)

    def leases() -> None:
        for _ in range(ROUNDS):
            grant = store.lease(keys(BATCH))
            store.release(grant.lease_id)

    def puts() -> None:
        for i in range(ROUNDS):
            put(1000 + i * BATCH)

    print(
        f"{label:20s} lease+release {calls(leases) / ROUNDS:5.0f} calls/op   "
        f"put_start+write+put_commit {calls(puts) / ROUNDS:5.0f} calls/op"
    )


def main() -> None:
    buffer = np.zeros(CONFIG.capacity_bytes, np.uint8)
    measure(HostStore(buffer, CONFIG, FakeClock()), buffer, "host")
    with tempfile.TemporaryDirectory() as disk_dir:
        buffer = np.zeros(CONFIG.capacity_bytes, np.uint8)
        tiers = TierConfig(disk_dir=disk_dir, disk_capacity_bytes=8 << 20, disk_slab_file_bytes=1 << 20)
        tiered = TieredStore(buffer, CONFIG, tiers, FakeClock())
        measure(tiered, buffer, "tiered (disk)")
        tiered.close()
    buffer = np.zeros(CONFIG.capacity_bytes, np.uint8)
    tiers = TierConfig(device_capacity_bytes=4 << 20, device="cpu")
    device = TieredStore(buffer, CONFIG, tiers, FakeClock(), device_allow_cpu=True)
    measure(device, buffer, "tiered (cpu device)")
    device.close()


if __name__ == "__main__":
    main()
