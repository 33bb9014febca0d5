"""KVSpec and Namespace: shapes, sizes, the canonical encoding (pinned), invalid specs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvpool.core.errors import InvalidArgument, SpecMismatch
from kvpool.core.spec import KVSpec, Namespace

TINY = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
MLA = KVSpec(
    model="deepseek", num_layers=3, num_kv_heads=1, head_dim=576, dtype="bfloat16", block_tokens=64,
    revision="r1", kind="mla",
)  # fmt: skip


def test_block_shape_is_layer_major_k_v_heads_tokens_dim() -> None:
    assert TINY.block_shape == (2, 2, 2, 16, 64)
    assert TINY.kv_factor == 2


def test_block_bytes_is_2_layers_heads_dim_dtype_per_token() -> None:
    assert TINY.bytes_per_token == 2 * 2 * 2 * 64 * 2
    assert TINY.block_bytes == 2 * 2 * 2 * 64 * 2 * 16 == 16384
    assert int(np.prod(TINY.block_shape)) * TINY.dtype_bytes == TINY.block_bytes


def test_mla_has_one_latent_per_layer() -> None:
    assert MLA.kv_factor == 1
    assert MLA.block_shape == (3, 1, 1, 64, 576)
    assert MLA.block_bytes == 3 * 1 * 1 * 64 * 576 * 2


def test_mla_needs_one_head() -> None:
    with pytest.raises(InvalidArgument, match="num_kv_heads=1"):
        dataclasses.replace(MLA, num_kv_heads=2)


@pytest.mark.parametrize(
    ("dtype", "holder", "size"),
    [("float32", "float32", 4), ("float16", "float16", 2), ("bfloat16", "uint16", 2),
     ("float8_e4m3fn", "uint8", 1), ("float8_e5m2", "uint8", 1), ("int8", "int8", 1), ("uint8", "uint8", 1)],
)  # fmt: skip
def test_numpy_holder_has_the_dtype_size(dtype: str, holder: str, size: int) -> None:
    spec = dataclasses.replace(TINY, dtype=dtype)
    assert spec.numpy_dtype == np.dtype(holder)
    assert spec.numpy_dtype.itemsize == size == spec.dtype_bytes
    assert spec.block_bytes == int(np.prod(spec.block_shape)) * size


def test_layer_range_bytes() -> None:
    per_layer = TINY.block_bytes // 2
    assert TINY.layer_range_bytes(0, 2) == (0, TINY.block_bytes)
    assert TINY.layer_range_bytes(1, 1) == (per_layer, per_layer)
    for first, count in [(-1, 1), (0, 0), (1, 2), (2, 1)]:
        with pytest.raises(InvalidArgument):
            TINY.layer_range_bytes(first, count)


@pytest.mark.parametrize(
    "changes",
    [{"model": ""}, {"num_layers": 0}, {"num_kv_heads": -1}, {"head_dim": 0}, {"block_tokens": 0},
     {"block_tokens": 1.5}, {"num_layers": True}, {"head_dim": "64"}, {"dtype": "float64"}, {"dtype": "fp16"},
     {"kind": "gqa"}],
)  # fmt: skip
def test_invalid_specs_raise_invalid_argument(changes: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument) as info:
        dataclasses.replace(TINY, **changes)  # type: ignore[arg-type]
    assert info.value.message  # says what is wrong


def test_spec_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.num_layers = 3  # type: ignore[misc]


def test_canonical_encoding_golden() -> None:
    """Pinned: changing the encoding silently would orphan every stored block."""
    assert TINY.canonical_encoding() == (
        b'kvpool-spec-v1|{"block_tokens":16,"dtype":"float16","head_dim":64,"kind":"mha","model":"tiny-llama",'
        b'"num_kv_heads":2,"num_layers":2,"revision":""}'
    )
    assert TINY.digest().hex() == "30f08ebff3c26810e4e6ee6f9e8dac01"
    assert MLA.digest().hex() == "ea3a07d4d59ee6a03ebee67e241da423"


def test_namespace_encoding_and_digest_golden() -> None:
    ns = Namespace(TINY, b"tenant-a")
    assert ns.encoding().hex() == (
        "0c0000006b76706f6f6c2d6e732d76311000000030f08ebff3c26810e4e6ee6f9e8dac010800000074656e616e742d6100000000"
    )
    assert ns.digest().hex() == "47db86cc11177c9891ac162e4262122d"


@pytest.mark.parametrize(
    "changes",
    [{"model": "tiny-llama-2"}, {"revision": "abc"}, {"num_layers": 3}, {"num_kv_heads": 4}, {"head_dim": 128},
     {"dtype": "bfloat16"}, {"block_tokens": 32}],
)  # fmt: skip
def test_every_field_changes_the_digest(changes: dict[str, object]) -> None:
    other = dataclasses.replace(TINY, **changes)  # type: ignore[arg-type]
    assert other.digest() != TINY.digest()
    assert other.canonical_encoding() != TINY.canonical_encoding()


def test_equal_specs_have_equal_digests() -> None:
    copy = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
    assert copy == TINY and copy.digest() == TINY.digest()


def test_canonical_encoding_is_injective_for_text_fields() -> None:
    a = dataclasses.replace(TINY, model="x|num_kv_heads=2|num_layers=2|revision=y", revision="")
    b = dataclasses.replace(TINY, model="x", revision="y|num_kv_heads=2|num_layers=2|revision=")
    assert a != b
    assert a.digest() != b.digest()


def test_namespace_separates_salt_and_adapter_without_ambiguity() -> None:
    digests = {
        Namespace(TINY).digest(),
        Namespace(TINY, b"a").digest(),
        Namespace(TINY, b"b").digest(),
        Namespace(TINY, b"", "a").digest(),  # same bytes as salt "a", but in the adapter slot
        Namespace(TINY, b"ab").digest(),
        Namespace(TINY, b"a", "b").digest(),  # "a" + "b" concatenated == "ab"
        Namespace(MLA, b"a").digest(),
    }
    assert len(digests) == 7
    assert all(len(d) == 16 for d in digests)


def test_require_same_names_both_specs() -> None:
    TINY.require_same(dataclasses.replace(TINY))
    other = dataclasses.replace(TINY, dtype="bfloat16")
    with pytest.raises(SpecMismatch) as info:
        TINY.require_same(other, "client")
    assert "float16" in info.value.message and "bfloat16" in info.value.message
    assert info.value.hint


def test_dict_round_trip_and_unknown_fields() -> None:
    assert KVSpec.from_dict(MLA.to_dict()) == MLA
    data = TINY.to_dict() | {"page_size": 16}
    with pytest.raises(InvalidArgument, match="page_size"):
        KVSpec.from_dict(data)
