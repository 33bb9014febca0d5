"""Paged gather/scatter against a per-token oracle: page sizes, NHD/HND, TP head ranges, bad input."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.errors import InvalidArgument, SpecMismatch
from kvpool.core.spec import KVSpec
from kvpool.kernels import paged
from kvpool.kernels.paged import (
    PagedLayout,
    blocks_to_tokens,
    convert_order,
    gather_blocks,
    scatter_blocks,
    tokens_to_blocks,
    tp_head_range,
)

torch.set_num_threads(1)


def _fill_cache_per_token(
    layout: PagedLayout, tokens: torch.Tensor, pages: list[int], num_pages: int
) -> list[torch.Tensor]:
    """Oracle: put token i of the request at (pages[i // page], i % page), one element group at a time."""
    num_layers, kvf, _, ntok, _ = tokens.shape
    caches = [torch.full(layout.page_shape(kvf, num_pages), -7.0) for _ in range(num_layers)]
    h0, hn = layout.head_start, layout.num_kv_heads
    for layer in range(num_layers):
        for i in range(ntok):
            page, slot = pages[i // layout.page_tokens], i % layout.page_tokens
            for kv in range(kvf):
                for h in range(hn):
                    value = tokens[layer, kv, h0 + h, i]
                    if layout.order == "NHD":
                        caches[layer][kv, page, slot, h] = value
                    else:
                        caches[layer][kv, page, h, slot] = value
    return caches


def _blocks_from_tokens(spec: KVSpec, tokens: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Oracle: canonical blocks straight from [L, kv, H, tok, D] tokens."""
    t = spec.block_tokens
    out = torch.empty(num_blocks, *spec.block_shape)
    for b in range(num_blocks):
        out[b] = tokens[:, :, :, b * t : (b + 1) * t]
    return out


def _page_table(kind: str, num_req_pages: int, unit: int, rng: random.Random) -> tuple[list[int], int]:
    """(request pages, pages in the cache). "random": scattered ids. "runs": groups of whole
    blocks (``unit`` pages each) on consecutive ids, the groups in random order with gaps, as
    an allocator hands out pages to a request that grew over time."""
    if kind == "random":
        num_pages = num_req_pages + 3
        return rng.sample(range(num_pages), num_req_pages), num_pages
    n_units = num_req_pages // unit
    cuts = sorted(rng.sample(range(1, n_units), rng.randint(0, n_units - 1)))
    groups = [range(s, e) for s, e in zip([0, *cuts], [*cuts, n_units], strict=True)]
    rng.shuffle(groups)
    pages = [0] * num_req_pages
    base = rng.randint(0, 2)
    for group in groups:
        for i, u in enumerate(group):
            for j in range(unit):
                pages[u * unit + j] = base + i * unit + j
        base += len(group) * unit + rng.randint(0, 2)
    return pages, base + 1


@settings(max_examples=80, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([2, 4]),
    page_tokens=st.sampled_from([2, 4, 8]),
    block_mult=st.sampled_from([(1, 1), (2, 1), (4, 1), (1, 2)]),  # (pages per block, blocks per page)
    order=st.sampled_from(["NHD", "HND"]),
    num_blocks=st.integers(1, 5),
    chunk=st.sampled_from([None, 1, 2]),
    strategy=st.sampled_from(["auto", "direct", "staged", "rows", "runs"]),
    table_kind=st.sampled_from(["random", "runs"]),
    workers=st.sampled_from([None, 1, 2]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    tp_rank_1=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gather_then_scatter_match_per_token_oracle(
    layers: int,
    heads: int,
    head_dim: int,
    page_tokens: int,
    block_mult: tuple[int, int],
    order: str,
    num_blocks: int,
    chunk: int | None,
    strategy: str,
    table_kind: str,
    workers: int | None,
    dtype: torch.dtype,
    tp_rank_1: bool,
    seed: int,
) -> None:
    """Every strategy, page table shape (scattered or consecutive runs) and thread count gives
    the oracle's bytes, for a whole model or one TP rank's head range; "runs" needs a runs
    table. Heads outside the rank's range stay untouched (NaN)."""
    ppb, bpp = block_mult
    block_tokens = page_tokens * ppb // bpp
    if block_tokens == 0:
        return
    if strategy == "runs":
        table_kind = "runs"
    h0 = heads if tp_rank_1 else 0  # TP=2 rank 1 holds the upper half of the model's heads
    spec = KVSpec(
        "m", layers, heads * (2 if tp_rank_1 else 1), head_dim, str(dtype).removeprefix("torch."), block_tokens
    )
    layout = PagedLayout(page_tokens, heads, head_dim, order, head_start=h0)
    gen = torch.Generator().manual_seed(seed)
    ntok = num_blocks * block_tokens
    num_req_pages = -(-ntok // page_tokens)
    pages, num_pages = _page_table(table_kind, num_req_pages, ppb if bpp == 1 else 1, random.Random(seed))
    tokens = torch.randn(layers, 2, spec.num_kv_heads, ntok, head_dim, generator=gen).to(dtype).float()
    caches = [c.to(dtype) for c in _fill_cache_per_token(layout, tokens, pages, num_pages)]

    out = torch.full((num_blocks, *spec.block_shape), float("nan"), dtype=dtype)
    kw: dict[str, Any] = {"chunk_blocks": chunk, "strategy": strategy, "workers": workers}
    gather_blocks(spec, layout, caches, pages, out, num_blocks, **kw)
    mine = slice(h0, h0 + heads)
    assert torch.equal(out[:, :, :, mine], _blocks_from_tokens(spec, tokens, num_blocks).to(dtype)[:, :, :, mine])
    assert out[:, :, :, :h0].isnan().all()

    fresh = [torch.full_like(c, -7.0) for c in caches]
    scatter_blocks(spec, layout, out, fresh, pages, num_blocks, **kw)
    for a, b in zip(fresh, caches):
        assert torch.equal(a, b)  # request pages rewritten exactly; other pages untouched (-7)


def test_runs_and_rows_refuse_what_they_cannot_address() -> None:
    spec = KVSpec("m", 2, 2, 4, "float32", 8)
    layout = PagedLayout(4, 2, 4)
    caches = [torch.zeros(layout.page_shape(2, 8)) for _ in range(2)]
    out = torch.zeros(2, *spec.block_shape)
    with pytest.raises(InvalidArgument, match="consecutive"):
        gather_blocks(spec, layout, caches, [0, 2, 4, 5], out, 2, strategy="runs")
    with pytest.raises(InvalidArgument, match="consecutive"):
        scatter_blocks(spec, layout, out, caches, [1, 0, 2, 3], 2, strategy="runs")
    strided = torch.zeros(2, *spec.block_shape[:-1], 8)[..., ::2]
    with pytest.raises(InvalidArgument, match="contiguous"):
        gather_blocks(spec, layout, caches, [0, 1, 2, 3], strided, 2, strategy="rows")
    with pytest.raises(InvalidArgument, match="workers"):
        gather_blocks(spec, layout, caches, [0, 1, 2, 3], out, 2, workers=0)


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_auto_gathers_into_non_contiguous_blocks_and_from_non_contiguous_caches(
    order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The "rows" and "runs" paths address flat memory; "auto" must fall back, not write into
    a copy. ROWS_MIN_BYTES=0 makes "auto" take "rows" for these tiny blocks whenever it may."""
    monkeypatch.setattr(paged, "ROWS_MIN_BYTES", 0)
    spec = KVSpec("m", 2, 2, 4, "float32", 8)
    layout = PagedLayout(4, 2, 4, order)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randn(2, 2, 2, 16, 4, generator=gen)
    for pages in ([5, 1, 0, 3], [2, 3, 4, 5]):  # scattered, then one run
        caches = _fill_cache_per_token(layout, tokens, pages, 6)
        strided = torch.full((2, *spec.block_shape[:-1], 8), float("nan"))[..., ::2]
        gather_blocks(spec, layout, caches, pages, strided, 2)
        assert torch.equal(strided, _blocks_from_tokens(spec, tokens, 2))
        wide = [torch.cat([c, torch.zeros_like(c)], dim=-1)[..., :4] for c in caches]  # same values, strided
        out = torch.full((2, *spec.block_shape), float("nan"))
        gather_blocks(spec, layout, wide, pages, out, 2)
        assert torch.equal(out, _blocks_from_tokens(spec, tokens, 2))
        back = [torch.full_like(torch.cat([c, c], dim=-1), -7.0)[..., :4] for c in caches]  # strided too
        scatter_blocks(spec, layout, out, back, pages, 2)
        assert all(torch.equal(a, c) for a, c in zip(back, caches))


def test_scatter_with_one_tensor_for_two_layers_keeps_serial_order() -> None:
    """Layers are written on threads only when each layer has its own tensor; with one tensor
    passed twice the last layer's bytes win, as with one thread."""
    spec = KVSpec("m", 2, 2, 4, "float32", 8)
    layout = PagedLayout(4, 2, 4)
    shared = torch.zeros(layout.page_shape(2, 4))
    blocks = torch.randn(2, *spec.block_shape)
    scatter_blocks(spec, layout, blocks, [shared, shared], [3, 1, 0, 2], 2, workers=2)
    back = torch.zeros(2, *spec.block_shape)
    gather_blocks(spec, layout, [shared, shared], [3, 1, 0, 2], back, 2)
    assert torch.equal(back[:, 0], blocks[:, 1]) and torch.equal(back[:, 1], blocks[:, 1])


@pytest.mark.parametrize("strategy", ["auto", "direct", "staged"])
def test_tp2_writer_and_tp4_reader_share_blocks(strategy: str) -> None:
    heads, layers, d, page = 4, 2, 8, 4
    spec = KVSpec("m", layers, heads, d, "float32", 8)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randn(layers, 2, heads, 16, d, generator=gen)
    pages = [3, 0, 5, 1]
    blocks = torch.zeros(2, *spec.block_shape)
    for rank in range(2):  # each TP=2 rank writes its own heads into the same blocks
        start, count = tp_head_range(heads, 2, rank)
        layout = PagedLayout(page, count, d, "NHD", head_start=start)
        caches = _fill_cache_per_token(layout, tokens, pages, 6)
        gather_blocks(spec, layout, caches, pages, blocks, 2, strategy=strategy)
    assert torch.equal(blocks, _blocks_from_tokens(spec, tokens, 2))
    for rank in range(4):  # each TP=4 rank loads only its head into its own HND cache
        start, count = tp_head_range(heads, 4, rank)
        layout = PagedLayout(page, count, d, "HND", head_start=start)
        mine = [torch.full(layout.page_shape(2, 6), -7.0) for _ in range(layers)]
        scatter_blocks(spec, layout, blocks, mine, pages, 2, strategy=strategy)
        assert all(torch.equal(a, b) for a, b in zip(mine, _fill_cache_per_token(layout, tokens, pages, 6)))


def test_tp_head_range_replicates_when_tp_exceeds_heads() -> None:
    assert [tp_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [tp_head_range(8, 2, r) for r in range(2)] == [(0, 4), (4, 4)]
    with pytest.raises(InvalidArgument):
        tp_head_range(6, 4, 0)


def test_wrong_dtype_layers_or_heads_refused_naming_both_specs() -> None:
    spec = KVSpec("llama", 2, 4, 8, "bfloat16", 16, revision="r1")
    layout = PagedLayout(16, 4, 8)
    out = torch.empty(1, *spec.block_shape, dtype=torch.bfloat16)
    fp32 = [torch.zeros(layout.page_shape(2, 2)) for _ in range(2)]
    with pytest.raises(SpecMismatch, match=r"llama@r1.*bfloat16") as err:
        gather_blocks(spec, layout, fp32, [0], out, 1)
    assert "float32" in str(err.value)
    bf = [c.to(torch.bfloat16) for c in fp32]
    with pytest.raises(SpecMismatch, match="3 layers"):
        gather_blocks(spec, layout, [*bf, bf[0]], [0], out, 1)
    with pytest.raises(SpecMismatch):
        gather_blocks(spec, PagedLayout(16, 8, 8), [torch.zeros(2, 2, 16, 8, 8, dtype=torch.bfloat16)] * 2, [0], out, 1)
    with pytest.raises(SpecMismatch, match="HND"):  # cache shaped NHD but declared HND: shape mismatch
        gather_blocks(
            spec, PagedLayout(16, 4, 8, "HND"), [torch.zeros(2, 2, 16, 4, 8, dtype=torch.bfloat16)] * 2, [0], out, 1
        )
    with pytest.raises(InvalidArgument):
        gather_blocks(spec, layout, bf, [9], out, 1)  # page id out of range
    with pytest.raises(InvalidArgument):
        gather_blocks(spec, layout, bf, [0], out, 1, strategy="fast")
    assert torch.equal(bf[0], torch.zeros_like(bf[0]))


def test_convert_order_roundtrip_and_blocks_tokens_inverse() -> None:
    cache = torch.randn(2, 3, 4, 5, 6)
    hnd = convert_order(cache, "NHD", "HND")
    assert hnd.shape == (2, 3, 5, 4, 6)
    assert torch.equal(hnd[1, 2, 3, :, 4], cache[1, 2, :, 3, 4])
    assert torch.equal(convert_order(hnd, "HND", "NHD"), cache)
    blocks = torch.randn(3, 2, 2, 4, 8, 5)
    toks = blocks_to_tokens(blocks, 1)
    assert torch.equal(toks[0, 2, 8:16], blocks[1, 1, 0, 2])
    back = torch.zeros_like(blocks)
    tokens_to_blocks(toks, back, 1)
    assert torch.equal(back[:, 1], blocks[:, 1])


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_threaded_gather_and_scatter_under_inference_mode(order: str) -> None:
    """vLLM runs its step under torch.inference_mode: worker threads must write its inference
    tensors too (inference mode is per thread; found by tools/bench_vllm.py)."""
    spec = KVSpec("m", 4, 2, 16, "float32", 8)
    layout = PagedLayout(8, 2, 16, order)
    with torch.inference_mode():
        caches = [torch.randn(*layout.page_shape(2, 6)) for _ in range(spec.num_layers)]
        out = torch.empty(3, *spec.block_shape)
        gather_blocks(spec, layout, caches, [4, 0, 2], out, 3, strategy="direct", workers=2)
        back = [torch.zeros_like(c) for c in caches]
        scatter_blocks(spec, layout, out, back, [4, 0, 2], 3, strategy="direct", workers=2)
    for c, b in zip(caches, back):
        assert torch.equal(c[:, [4, 0, 2]], b[:, [4, 0, 2]])
