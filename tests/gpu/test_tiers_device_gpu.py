"""The device tier on a real CUDA device: bytes round-trip through HBM, the host arena is
page-locked, and the tiered store promotes from HBM with verified bytes."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig, TierConfig
from kvpool.storage.device_tier import DeviceTier
from kvpool.storage.tiered_store import TieredStore

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_device_tier_round_trip_and_eviction_on_cuda() -> None:
    demoted: list[bytes] = []
    tier = DeviceTier(1 << 20, 1 << 18, device="cuda", on_evict=lambda k, ns, c, d: demoted.append(k))
    blocks = {i.to_bytes(16, "little"): np.random.default_rng(i).integers(0, 256, 60_000, dtype=np.uint8)
              for i in range(20)}  # fmt: skip
    for k, d in blocks.items():
        assert tier.put(k, b"ns", d, checksum64(d))
    assert tier.arena.device.type == "cuda"
    assert demoted and tier.used_bytes <= tier.capacity_bytes
    for k, d in blocks.items():
        got = tier.get(k)
        if k in demoted:
            assert got is None
        else:
            assert got is not None and np.array_equal(got[2], d)
    tier.close()


def test_tiered_store_pins_host_and_promotes_from_hbm() -> None:
    cfg = StoreConfig(capacity_bytes=1 << 20, slab_bytes=1 << 18)
    buffer = np.zeros(cfg.capacity_bytes, np.uint8)
    store = TieredStore(buffer, cfg, TierConfig(device_capacity_bytes=1 << 20, device="cuda"), FakeClock())
    assert store.device is not None and store.summary()["tiers"]["device"]["host_pinned"]
    k = (7).to_bytes(16, "little")
    d = np.random.default_rng(7).integers(0, 256, 8000, dtype=np.uint8)
    grant = store.put_start(bytes(16), [k], d.size)
    buffer[grant.slots[0][1] : grant.slots[0][1] + d.size] = d
    store.put_commit(grant.put_id, [checksum64(d)])
    for _ in range(2):
        lease = store.lease([k])
        store.release(lease.lease_id)
    assert store.device.contains(k)
    store.host.remove([k])
    lease = store.lease([k])
    loc = lease.locations[0]
    assert np.array_equal(buffer[loc.offset : loc.offset + loc.size], d)
    store.close()
