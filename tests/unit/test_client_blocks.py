"""Block arrays <-> arena rows: shape/dtype checks, torch tensors, checksums on both ends."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvpool.client.blocks import block_rows, read_rows, write_rows
from kvpool.core.checksum import checksum64
from kvpool.core.errors import InvalidArgument
from kvpool.core.spec import KVSpec

SPEC = KVSpec(model="tiny", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)


def blocks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *SPEC.block_shape)).astype(np.float16)


def test_rows_are_views_of_block_bytes() -> None:
    arr = blocks(3)
    rows = block_rows(arr, SPEC, "blocks")
    assert rows.shape == (3, SPEC.block_bytes) and rows.dtype == np.uint8
    assert np.shares_memory(rows, arr)
    assert rows[1].tobytes() == arr[1].tobytes()


def test_wrong_shape_names_the_expected_shape() -> None:
    bad = np.zeros((2, 2, 2, 2, 5, 8), dtype=np.float16)  # 5 tokens per block instead of 4
    with pytest.raises(InvalidArgument) as info:
        block_rows(bad, SPEC, "blocks")
    assert "[n, 2, 2, 2, 4, 8]" in info.value.message and "(2, 2, 2, 2, 5, 8)" in info.value.message
    with pytest.raises(InvalidArgument, match=r"\[n, 2, 2, 2, 4, 8\]"):
        block_rows(np.zeros(SPEC.block_shape, dtype=np.float16), SPEC, "blocks")  # missing the n axis


def test_wrong_numpy_dtype_names_both() -> None:
    with pytest.raises(InvalidArgument) as info:
        block_rows(blocks(1).astype(np.float32), SPEC, "blocks")
    assert "float32" in info.value.message and "float16" in info.value.message


def test_non_contiguous_and_read_only() -> None:
    arr = np.zeros((2, *SPEC.block_shape[:-1], 16), dtype=np.float16)[..., ::2]
    with pytest.raises(InvalidArgument, match="contiguous"):
        block_rows(arr, SPEC, "out")
    ro = blocks(1)
    ro.flags.writeable = False
    block_rows(ro, SPEC, "blocks")  # fine for reading
    with pytest.raises(InvalidArgument, match="read-only"):
        block_rows(ro, SPEC, "out", writable=True)


def test_torch_tensors_including_bfloat16() -> None:
    torch = pytest.importorskip("torch")
    t = torch.randn(2, *SPEC.block_shape, dtype=torch.float16)
    rows = block_rows(t, SPEC, "blocks")
    assert rows.tobytes() == t.numpy().tobytes()
    bf = dataclasses.replace(SPEC, dtype="bfloat16")
    tb = torch.randn(2, *bf.block_shape, dtype=torch.bfloat16)
    rows = block_rows(tb, bf, "blocks", writable=True)
    assert rows.tobytes() == tb.view(torch.int16).numpy().tobytes()
    rows[0, :2] = 0  # a writable view of the tensor's own memory
    assert tb.view(torch.int16).reshape(-1)[0].item() == 0
    with pytest.raises(InvalidArgument, match="bfloat16"):
        block_rows(torch.zeros(1, *bf.block_shape, dtype=torch.float16), bf, "blocks")
    with pytest.raises(InvalidArgument, match="contiguous"):
        block_rows(torch.zeros(2, *SPEC.block_shape, dtype=torch.float16).transpose(4, 5).contiguous()
                   .transpose(4, 5), SPEC, "blocks")  # fmt: skip


def test_write_then_read_round_trip_with_checksums() -> None:
    arena = np.zeros(8 * SPEC.block_bytes, dtype=np.uint8)
    src = block_rows(blocks(3, seed=1), SPEC, "blocks")
    offsets = [5 * SPEC.block_bytes, 0, 2 * SPEC.block_bytes]
    sums = write_rows(arena, src, [2, 0, 1], offsets)
    assert sums == [checksum64(src[2]), checksum64(src[0]), checksum64(src[1])]
    dst = np.zeros_like(src)
    assert read_rows(arena, dst, offsets, sums, "test") == 3
    assert np.array_equal(dst[0], src[2]) and np.array_equal(dst[1], src[0]) and np.array_equal(dst[2], src[1])


def test_read_stops_at_the_first_corrupt_block() -> None:
    arena = np.zeros(4 * SPEC.block_bytes, dtype=np.uint8)
    src = block_rows(blocks(3, seed=2), SPEC, "blocks")
    offsets = [0, SPEC.block_bytes, 2 * SPEC.block_bytes]
    sums = write_rows(arena, src, [0, 1, 2], offsets)
    arena[SPEC.block_bytes + 17] ^= 0xFF  # corrupt block 1 in the arena
    dst = np.zeros_like(src)
    assert read_rows(arena, dst, offsets, sums, "test") == 1
    assert np.array_equal(dst[0], src[0])
    # block 2 may have been copied with its run (adjacent blocks move in one call), but it is
    # not counted as read: get_into's rows past the count are "untouched or partially written"
