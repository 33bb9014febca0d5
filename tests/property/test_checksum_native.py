"""The one-pass copy + checksum (kvpool/core/checksum.py, kvpool/core/_xxh3copy.c) computes
exactly xxh3-64, the digest every store, disk file and peer already holds: the AVX2 kernel,
the portable C kernel and the numpy + xxhash path, over lengths on both sides of every
boundary of the algorithm (240-byte short inputs, 64-byte stripes, 1,024-byte blocks), odd
alignments of source and destination, and buffers of several blocks."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core import checksum as checksum_mod
from kvpool.core.checksum import checksum64, checksum_at, checksum_rows, copy_checksum_rows, native_kernel

try:
    from kvpool.core import _xxh3copy as native
except ImportError:  # a failure below says how to build it
    native = None

NOT_BUILT = (
    "kvpool.core._xxh3copy was not built (no C compiler when kvpool was installed?): install gcc and the "
    "Python headers, then run 'bash tools/dev.sh setup' again; kvpool works without it, on a slower path"
)

#: lengths at and around the algorithm's edges: short path, first stripe, block, and beyond
EDGES = [241, 255, 256, 257, 319, 320, 1023, 1024, 1025, 1087, 1088, 1089, 2047, 2048, 2049, 4096, 65536 + 63]


def _rows(n: int, block_bytes: int, seed: int, skew: int = 0) -> np.ndarray:
    """[n, block_bytes] random rows starting ``skew`` bytes into a fresh buffer (odd alignment)."""
    raw = np.random.default_rng(seed).integers(0, 256, n * block_bytes + skew, dtype=np.uint8)
    return raw[skew:].reshape(n, block_bytes)


def _want(rows: np.ndarray) -> list[int]:
    return [xxhash.xxh3_64_intdigest(rows[k].tobytes()) for k in range(rows.shape[0])]


def test_the_native_kernel_is_built_and_picked_by_the_cpu() -> None:
    """Installed with a C compiler (tools/dev.sh, CI): the one-pass kernel is in use, and it
    is the AVX2 one on a CPU that has AVX2."""
    assert native_kernel() in {"avx2", "scalar"}, NOT_BUILT
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if cpuinfo.exists() and " avx2" in cpuinfo.read_text():
        assert native_kernel() == "avx2"


def _aligned(nbytes: int, skew: int) -> np.ndarray:
    """Zeroed bytes starting ``skew`` bytes past a 64-byte boundary."""
    raw = np.zeros(nbytes + 128, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64 + skew
    return raw[start : start + nbytes]


@pytest.mark.parametrize("block_bytes", EDGES)
@pytest.mark.parametrize(
    ("scalar", "stream", "dst_skew"),
    [(False, False, 0), (True, False, 0), (False, True, 0), (False, True, 16), (False, True, 1), (True, True, 0)],
)
def test_both_kernels_copy_and_hash_at_every_edge(block_bytes: int, scalar: bool, stream: bool, dst_skew: int) -> None:
    """Plain and streamed stores (taken only where dst is 32-byte aligned: the skews check
    the fallback), the AVX2 and the portable kernel: one copy, one digest."""
    assert native is not None, NOT_BUILT
    src = _rows(3, block_bytes, block_bytes, skew=block_bytes % 7)
    dst = _aligned(3 * block_bytes, dst_skew).reshape(3, block_bytes)
    assert native.copy_blocks(dst, src, block_bytes, scalar, stream) == _want(src)
    assert np.array_equal(dst, src)
    assert native.hash_blocks(src, block_bytes, scalar) == _want(src)


@settings(max_examples=150, deadline=None)
@given(
    block_bytes=st.integers(1, 9000),
    n=st.integers(0, 4),
    src_skew=st.integers(0, 63),
    dst_skew=st.integers(0, 63),
    seed=st.integers(0, 2**32 - 1),
    portable=st.booleans(),
    stream=st.booleans(),
)
def test_copy_checksum_rows_is_a_copy_and_the_one_shot_digest(
    block_bytes: int, n: int, src_skew: int, dst_skew: int, seed: int, portable: bool, stream: bool
) -> None:
    src = _rows(n, block_bytes, seed, src_skew)
    dst = _aligned(n * block_bytes, dst_skew).reshape(n, block_bytes)
    assert copy_checksum_rows(dst, src, portable=portable, stream=stream) == _want(src)
    assert np.array_equal(dst, src)
    assert checksum_rows(src) == _want(src)
    if n:
        assert checksum64(src[0]) == _want(src[:1])[0] == checksum64(src[0].tobytes())


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=20_000), piece=st.integers(1, 5000))
def test_the_portable_path_over_any_piece_size_is_the_one_shot_digest(data: bytes, piece: int) -> None:
    """The numpy + xxhash path copies in pieces and streams them into xxh3: exact whatever
    the piece boundaries."""
    old = checksum_mod.COPY_PIECE_BYTES
    checksum_mod.COPY_PIECE_BYTES = piece
    try:
        src = np.frombuffer(data, dtype=np.uint8).reshape(1, -1)
        dst = np.zeros_like(src)
        assert copy_checksum_rows(dst, src, portable=True) == [xxhash.xxh3_64_intdigest(data)]
        assert dst.tobytes() == data
    finally:
        checksum_mod.COPY_PIECE_BYTES = old


def test_bad_arguments_are_refused_and_change_nothing() -> None:
    assert native is not None, NOT_BUILT
    dst = np.zeros(600, dtype=np.uint8)
    src = np.ones(600, dtype=np.uint8)
    with pytest.raises(ValueError, match="not a whole number"):
        native.copy_blocks(dst, src, 250)
    with pytest.raises(ValueError, match="more than 240"):
        native.copy_blocks(dst, src, 100)
    with pytest.raises(ValueError, match="dst has 600 bytes, src 601"):
        native.copy_blocks(dst, np.ones(601, dtype=np.uint8), 600)
    with pytest.raises(TypeError):
        native.copy_blocks(bytes(600), src, 600)  # a read-only destination
    with pytest.raises(ValueError, match="rows into"):
        copy_checksum_rows(dst.reshape(2, 300), src.reshape(3, 200))
    assert not dst.any()


@settings(max_examples=60, deadline=None)
@given(
    block_bytes=st.sampled_from([64, 241, 1000, 4096]),
    order=st.permutations(list(range(6))),
    gaps=st.lists(st.booleans(), min_size=6, max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_checksum_at_hashes_each_block_in_the_order_asked(
    block_bytes: int, order: list[int], gaps: list[bool], seed: int
) -> None:
    """Slots side by side (one call per run) or apart, asked in any order: one digest per
    offset, each the xxh3-64 of that block."""
    offsets, cursor = [], 0
    for gap in gaps:
        offsets.append(cursor)
        cursor += block_bytes * (2 if gap else 1)
    buffer = np.random.default_rng(seed).integers(0, 256, cursor, dtype=np.uint8)
    asked = [offsets[i] for i in order]
    want = [xxhash.xxh3_64_intdigest(buffer[o : o + block_bytes].tobytes()) for o in asked]
    assert checksum_at(buffer, asked, block_bytes) == want
    assert checksum_at(buffer, [], block_bytes) == []
