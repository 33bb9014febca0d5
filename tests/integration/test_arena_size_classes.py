"""Arena space moves between block sizes in a real daemon ([perf] item 7).

A daemon filled with one block size, then emptied (by ``remove``) or overfilled (so that
eviction has to empty whole slabs), must take blocks of another size: the allocator returns
every emptied slab to one pool shared by all size classes, and eviction frees whole slabs
when a new size class needs one. The largest case is a 2 MiB block (one 16-token block of
Llama-3-8B), which needs a slab to itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import start_daemon

from kvpool import KVSpec, PoolClient

CAPACITY_BYTES = 64 << 20
BIG = KVSpec(model="big", num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", block_tokens=16)


def _spec(heads: int) -> KVSpec:
    return KVSpec(model=f"h{heads}", num_layers=2, num_kv_heads=heads, head_dim=64, dtype="float16", block_tokens=16)


def _fill(client: PoolClient, spec: KVSpec, total_bytes: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    n = total_bytes // spec.block_bytes
    hashes = client.hashes(list(range(seed, seed + n * spec.block_tokens)))
    blocks = np.random.default_rng(seed).standard_normal((n, *spec.block_shape)).astype(spec.numpy_dtype)
    for start in range(0, n, 128):
        client.put(hashes[start : start + 128], blocks[start : start + 128])
    return hashes, blocks


@pytest.mark.parametrize("empty_by", ["remove", "eviction"])
def test_space_of_one_block_size_is_reused_by_others(empty_by: str) -> None:
    daemon = start_daemon(capacity=f"{CAPACITY_BYTES}")
    try:
        fill_bytes = CAPACITY_BYTES * 3 // 4 if empty_by == "remove" else CAPACITY_BYTES * 3 // 2
        for round_no, heads in enumerate([1, 4, 3, 8]):
            spec = _spec(heads)
            with PoolClient.connect(daemon.address, spec, salt=b"t") as client:
                hashes, blocks = _fill(client, spec, fill_bytes, seed=round_no * 1_000_000)
                # the newest blocks are present and exact, whatever was evicted to make room
                tail = min(len(hashes), (CAPACITY_BYTES // 2) // spec.block_bytes)
                assert client.lookup(hashes[-tail:]) == tail
                assert np.array_equal(client.get(hashes[-tail:]), blocks[-tail:])
                if empty_by == "remove":
                    assert client.remove(hashes) == len(hashes)
                    assert client.stats()["used_bytes"] == 0
        with PoolClient.connect(daemon.address, BIG, salt=b"t") as client:
            hashes = client.hashes(list(range(16 * 4)))
            blocks = np.random.default_rng(7).standard_normal((4, *BIG.block_shape)).astype(BIG.numpy_dtype)
            assert client.put(hashes, blocks).stored == 4
            assert np.array_equal(client.get(hashes), blocks)
    finally:
        daemon.cleanup()
