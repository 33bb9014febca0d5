"""The block-hash chain ``kvpool-h1``: golden vectors, the formula, input types, bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvpool.core.errors import InvalidArgument
from kvpool.core.hashing import (
    HASH_BYTES,
    HASH_SCHEME,
    as_token_array,
    block_hashes,
    chain_hashes,
    pack_hashes,
    unpack_hashes,
)
from kvpool.core.spec import KVSpec, Namespace

TINY = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
NS = Namespace(TINY, b"tenant-a")

# Computed once from the code at the time the scheme was frozen; a change here means every
# stored block everywhere would silently stop matching: bump HASH_SCHEME instead.
GOLDEN_RANGE40 = ["3d639e7d5096de85d1ab6c6c268ed22a", "0184c27abb50411e33ad30a5278b06e0"]
GOLDEN_EXTRAS = ["f4cb1585cc250d1c69574a59e5ebbe01", "6ced33befbaf4fdf11b60e6146dcf53c"]
GOLDEN_ZERO_SEED = "154f19ec1cd762d22e21ca7bd3ac2558"


def test_scheme_name_is_pinned() -> None:
    assert HASH_SCHEME == "kvpool-h1"
    assert HASH_BYTES == 16


def test_golden_vectors() -> None:
    assert [h.hex() for h in block_hashes(NS, list(range(40)))] == GOLDEN_RANGE40
    assert [h.hex() for h in block_hashes(NS, list(range(32)), extras=[b"img0", b""])] == GOLDEN_EXTRAS
    assert chain_hashes(bytes(16), [1, 2, 3, 4], 2)[1].hex() == GOLDEN_ZERO_SEED


def test_chain_matches_the_documented_formula() -> None:
    """h_i = xxh3_128(h_{i-1} || tokens_i as little-endian u32 || extra_i), h0 = namespace digest."""
    tokens = [7, 0xFFFFFFFF, 3, 70000] * 8  # 32 tokens = 2 blocks of 16
    extras = [b"", b"\x01\x02"]
    prev = NS.digest()
    expected = []
    for i in range(2):
        chunk = b"".join(t.to_bytes(4, "little") for t in tokens[16 * i : 16 * (i + 1)])
        prev = xxhash.xxh3_128_digest(prev + chunk + extras[i])
        expected.append(prev)
    assert block_hashes(NS, tokens, extras) == expected
    assert block_hashes(NS, tokens)[0] == expected[0]  # empty extra == no extra


def test_only_full_blocks_are_hashed() -> None:
    assert block_hashes(NS, list(range(15))) == []
    assert len(block_hashes(NS, list(range(16)))) == 1
    assert len(block_hashes(NS, list(range(47)))) == 2
    assert block_hashes(NS, list(range(47))) == block_hashes(NS, list(range(32)))
    assert block_hashes(NS, []) == []


def test_token_array_types_give_the_same_hashes() -> None:
    torch = pytest.importorskip("torch")
    tokens = [5, 1, 0, 151_000, 2**31 + 5] * 10
    want = block_hashes(NS, tokens)
    assert len(want) == 3
    for variant in (
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.uint32),
        np.array(tokens, dtype=np.uint64),
        np.array(tokens, dtype=np.int64)[::1],
        np.repeat(np.array(tokens, dtype=np.int64), 2)[::2],  # strided view
        torch.tensor(tokens, dtype=torch.int64),
        tuple(tokens),
    ):
        assert block_hashes(NS, variant) == want, type(variant)
    big_endian = np.array(tokens, dtype=">i8")
    assert block_hashes(NS, big_endian) == want


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ([[1, 2], [3, 4]], "1-D"),
        (np.zeros((2, 16), dtype=np.int64), "1-D"),
        ([1.5] * 16, "integers"),
        (np.ones(16, dtype=np.float32), "integers"),
        ([-1] + [0] * 15, "32-bit"),
        ([2**32] + [0] * 15, "32-bit"),
        (["a"] * 16, "integers"),
    ],
)
def test_invalid_tokens_raise_invalid_argument(bad: object, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        block_hashes(NS, bad)


def test_invalid_chain_arguments() -> None:
    with pytest.raises(InvalidArgument, match="16 bytes"):
        chain_hashes(b"short", [1] * 16, 16)
    with pytest.raises(InvalidArgument, match="block_tokens"):
        chain_hashes(bytes(16), [1] * 16, 0)
    with pytest.raises(InvalidArgument, match="extras"):
        block_hashes(NS, list(range(32)), extras=[b"x"])


def test_as_token_array_is_little_endian_u32() -> None:
    arr = as_token_array(np.array([1, 258], dtype=">i4"))
    assert arr.dtype == np.dtype("<u4")
    assert arr.tobytes() == b"\x01\x00\x00\x00\x02\x01\x00\x00"


def test_pack_unpack_round_trip_and_errors() -> None:
    hashes = block_hashes(NS, list(range(64)))
    packed = pack_hashes(hashes)
    assert len(packed) == 64 and unpack_hashes(packed) == hashes
    assert unpack_hashes(b"") == []
    with pytest.raises(InvalidArgument, match="16 bytes"):
        pack_hashes([hashes[0], b"x" * 15])
    with pytest.raises(InvalidArgument, match="multiple of 16"):
        unpack_hashes(packed[:-1])


_CHILD = """
import sys
from kvpool.core.hashing import block_hashes
from kvpool.core.spec import KVSpec, Namespace
spec = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
for salt in (b"", b"tenant-a", b"tenant-b"):
    ns = Namespace(spec, salt, "lora-1" if salt else "")
    print(",".join(h.hex() for h in block_hashes(ns, [(i * 7919) % 50000 for i in range(200)])))
"""


def test_deterministic_across_processes_with_different_hash_seeds() -> None:
    outputs = []
    for seed in ("0", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
        outputs.append(done.stdout)
    mine = []
    for salt in (b"", b"tenant-a", b"tenant-b"):
        ns = Namespace(TINY, salt, "lora-1" if salt else "")
        mine.append(",".join(h.hex() for h in block_hashes(ns, [(i * 7919) % 50000 for i in range(200)])))
    assert outputs[0] == outputs[1] == outputs[2] == "\n".join(mine) + "\n"
    lines = outputs[0].splitlines()
    assert len(lines) == 3 and len(set(lines)) == 3  # the three namespaces differ
