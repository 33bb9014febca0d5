"""Hypothesis properties of the block-hash chain: prefix property, full blocks only,
locality of changes, namespace separation, extras, input-type independence."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.hashing import block_hashes
from kvpool.core.spec import KVSpec, Namespace

TOKEN = st.integers(min_value=0, max_value=2**32 - 1)
TOKENS = st.lists(TOKEN, min_size=0, max_size=120)
BLOCK_TOKENS = st.sampled_from([1, 2, 3, 4, 8, 16])
SETTINGS = settings(max_examples=60, deadline=None)


def spec_for(block_tokens: int) -> KVSpec:
    return KVSpec(model="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=block_tokens)


@SETTINGS
@given(tokens=TOKENS, block_tokens=BLOCK_TOKENS, cut=st.integers(min_value=0, max_value=120))
def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes(tokens: list[int], block_tokens: int, cut: int) -> None:
    ns = Namespace(spec_for(block_tokens), b"s")
    full = block_hashes(ns, tokens)
    part = block_hashes(ns, tokens[:cut])
    assert len(full) == len(tokens) // block_tokens  # only full blocks
    assert part == full[: len(part)]
    assert len(part) == min(cut, len(tokens)) // block_tokens
    assert all(len(h) == 16 for h in full)


@SETTINGS
@given(tokens=st.lists(TOKEN, min_size=16, max_size=96), block_tokens=BLOCK_TOKENS, data=st.data())
def test_changing_a_token_changes_its_block_and_every_later_one(
    tokens: list[int], block_tokens: int, data: st.DataObject
) -> None:
    ns = Namespace(spec_for(block_tokens))
    n_blocks = len(tokens) // block_tokens
    pos = data.draw(st.integers(min_value=0, max_value=n_blocks * block_tokens - 1))
    new_value = data.draw(TOKEN.filter(lambda v: v != tokens[pos]))
    changed = list(tokens)
    changed[pos] = new_value
    before, after = block_hashes(ns, tokens), block_hashes(ns, changed)
    block = pos // block_tokens
    assert before[:block] == after[:block]
    assert all(b != a for b, a in zip(before[block:], after[block:], strict=True))


@SETTINGS
@given(
    tokens=st.lists(TOKEN, min_size=8, max_size=64),
    salt_a=st.binary(max_size=8),
    salt_b=st.binary(max_size=8),
    adapter_a=st.text(max_size=4),
    adapter_b=st.text(max_size=4),
)
def test_different_namespaces_share_no_hash(
    tokens: list[int], salt_a: bytes, salt_b: bytes, adapter_a: str, adapter_b: str
) -> None:
    spec = spec_for(4)
    a, b = Namespace(spec, salt_a, adapter_a), Namespace(spec, salt_b, adapter_b)
    if a == b:
        assert block_hashes(a, tokens) == block_hashes(b, tokens)
    else:
        assert not set(block_hashes(a, tokens)) & set(block_hashes(b, tokens))


@SETTINGS
@given(
    tokens=st.lists(TOKEN, min_size=8, max_size=64),
    field=st.sampled_from(["model", "revision", "num_layers", "num_kv_heads", "head_dim", "dtype", "kind"]),
)
def test_any_spec_field_separates_the_hashes(tokens: list[int], field: str) -> None:
    base = spec_for(4)
    other_value: object = {
        "model": "m2", "revision": "r2", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "bfloat16",
        "kind": "mla",
    }[field]  # fmt: skip
    other = dataclasses.replace(base, **{field: other_value})  # type: ignore[arg-type]
    a, b = block_hashes(Namespace(base), tokens), block_hashes(Namespace(other), tokens)
    assert len(a) == len(b) >= 2
    assert not set(a) & set(b)


@SETTINGS
@given(tokens=st.lists(TOKEN, min_size=12, max_size=48), data=st.data())
def test_an_extra_changes_its_block_and_later_ones_only(tokens: list[int], data: st.DataObject) -> None:
    ns = Namespace(spec_for(4))
    n = len(tokens) // 4
    j = data.draw(st.integers(min_value=0, max_value=n - 1))
    extra = data.draw(st.binary(min_size=1, max_size=16))
    extras = [b""] * n
    extras[j] = extra
    plain, mixed = block_hashes(ns, tokens), block_hashes(ns, tokens, extras)
    assert plain[:j] == mixed[:j]
    assert all(p != m for p, m in zip(plain[j:], mixed[j:], strict=True))


@SETTINGS
@given(tokens=TOKENS, block_tokens=BLOCK_TOKENS)
def test_list_and_numpy_int64_and_uint32_agree(tokens: list[int], block_tokens: int) -> None:
    ns = Namespace(spec_for(block_tokens), b"x")
    want = block_hashes(ns, tokens)
    assert block_hashes(ns, np.array(tokens, dtype=np.int64)) == want
    assert block_hashes(ns, np.array(tokens, dtype=np.uint32)) == want
    assert block_hashes(ns, np.array(tokens, dtype=np.int64)) == block_hashes(ns, np.array(tokens, dtype=np.int64))
