"""Gather an engine's paged KV cache into canonical pool blocks, and scatter them back.

Engines keep KV per layer in fixed-size pages (vLLM-style ``[kv, num_pages, page_tokens,
kv_heads, head_dim]``, "NHD", or ``[kv, num_pages, kv_heads, page_tokens, head_dim]``,
"HND"). The pool keeps one object per block in the canonical layout
``[layer][k|v][kv_head][token][head_dim]`` (``KVSpec.block_shape``), so that:

* engine page size and pool block size are independent: a pool block spans
  ``block_tokens // page_tokens`` pages, or one page holds ``page_tokens // block_tokens``
  pool blocks;
* a tensor-parallel rank that holds kv heads ``[head_start, head_start + heads)`` reads and
  writes only that head range of every layer of the same pool blocks (TP=2 writer, TP=4
  reader share keys and bytes).

The implementation is plain torch (and numpy views of CPU tensors), so the same code runs on
CPU (the oracle) and on CUDA tensors. Two strategies, tested against the same oracle:

* "direct" (CPU default): one pass per (layer, page slot of a block): ``index_select`` writes
  straight into a strided view of the blocks; scatter is one numpy fancy-index assignment from a
  strided view (numpy moves whole rows with memcpy; torch's ``index_copy_`` was ~3x slower).
* "staged" (other devices): page rows into a small scratch that stays in cache, then one
  transpose copy; scatter transposes into a scratch in page order, then writes whole page rows.

Measured GB/s against a plain copy are in docs/engine.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.core.errors import InvalidArgument, SpecMismatch
from kvpool.core.spec import KVSpec

ORDERS = ("NHD", "HND")

#: KVSpec.dtype -> torch dtype of an engine cache that may be gathered into it.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}

#: Bytes of pages moved per chunk (None in a call = pick from these). Gather: the scratch
#: should stay in L2 (1 MiB per core on the bench machine) between the row gather and the
#: transpose. Scatter: larger chunks amortise the per-call cost of the row writes.
GATHER_CHUNK_BYTES = 1 << 20
SCATTER_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class PagedLayout:
    """How one engine (or one TP rank of it) lays out its per-layer paged KV cache.

    ``head_start``/``num_kv_heads`` are this rank's contiguous slice of the model's kv heads;
    a TP=1 engine has ``head_start=0`` and all heads.
    """

    page_tokens: int
    num_kv_heads: int
    head_dim: int
    order: str = "NHD"
    head_start: int = 0

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise InvalidArgument(f"page order {self.order!r} is not one of {ORDERS}")
        for name in ("page_tokens", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"PagedLayout.{name} must be positive, got {getattr(self, name)}")
        if self.head_start < 0:
            raise InvalidArgument(f"PagedLayout.head_start must be >= 0, got {self.head_start}")

    def page_shape(self, kv_factor: int, num_pages: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor in this layout."""
        if self.order == "NHD":
            return (kv_factor, num_pages, self.page_tokens, self.num_kv_heads, self.head_dim)
        return (kv_factor, num_pages, self.num_kv_heads, self.page_tokens, self.head_dim)


def tp_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(head_start, heads) of ``tp_rank``: contiguous, equal slices, as vLLM/SGLang shard kv heads.

    When ``tp_size > num_kv_heads`` engines replicate kv heads; each rank then holds one head,
    ``tp_size // num_kv_heads`` ranks sharing it.
    """
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise InvalidArgument(f"tp_rank {tp_rank} is outside tp_size {tp_size}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise InvalidArgument(f"{num_kv_heads} kv heads do not split evenly over TP={tp_size}")
        per = num_kv_heads // tp_size
        return tp_rank * per, per
    if tp_size % num_kv_heads:
        raise InvalidArgument(f"TP={tp_size} is not a multiple of {num_kv_heads} kv heads")
    return tp_rank // (tp_size // num_kv_heads), 1


def check_caches(spec: KVSpec, layout: PagedLayout, kv_caches: Sequence[torch.Tensor]) -> int:
    """Refuse a cache of another layout, dtype or head count before a byte moves.

    Returns the number of pages per layer. Raises SpecMismatch naming both sides.
    """
    where = f"engine cache ({layout.order}, page_tokens={layout.page_tokens}, heads "
    where += f"[{layout.head_start}, {layout.head_start + layout.num_kv_heads}), head_dim={layout.head_dim})"
    if len(kv_caches) != spec.num_layers:
        raise SpecMismatch(
            f"{where} has {len(kv_caches)} layers, the pool spec [{spec.describe()}] has {spec.num_layers}",
            hint="connect the engine to a pool namespace of the same model",
        )
    if layout.head_dim != spec.head_dim or layout.head_start + layout.num_kv_heads > spec.num_kv_heads:
        raise SpecMismatch(
            f"{where} does not fit the pool spec [{spec.describe()}]",
            hint="the engine's kv heads/head_dim must be a slice of the pool spec's",
        )
    if layout.page_tokens % spec.block_tokens and spec.block_tokens % layout.page_tokens:
        raise SpecMismatch(
            f"{where}: page_tokens={layout.page_tokens} and block_tokens={spec.block_tokens} do not divide",
            hint="pick a pool block size that is a multiple or a divisor of the engine page size",
        )
    want_dtype = TORCH_DTYPES[spec.dtype]
    num_pages = kv_caches[0].shape[1] if kv_caches[0].dim() == 5 else -1
    want_shape = layout.page_shape(spec.kv_factor, num_pages)
    for i, cache in enumerate(kv_caches):
        if cache.dtype != want_dtype:
            raise SpecMismatch(
                f"{where} layer {i} has dtype {cache.dtype}, the pool spec [{spec.describe()}] wants {want_dtype}",
                hint="use a pool namespace with the engine's KV dtype",
            )
        if tuple(cache.shape) != want_shape:
            raise SpecMismatch(
                f"{where} layer {i} has shape {tuple(cache.shape)}, expected {want_shape} "
                f"for the pool spec [{spec.describe()}]",
                hint="pass the per-layer cache tensors in the layout named by PagedLayout",
            )
    return int(num_pages)


def _block_view(out: torch.Tensor, spec: KVSpec, n: int) -> None:
    if out.dim() != 6 or tuple(out.shape[1:]) != spec.block_shape or out.shape[0] < n:
        raise InvalidArgument(
            f"blocks tensor has shape {tuple(out.shape)}, expected [>={n}, *{spec.block_shape}]",
            hint="allocate with torch.empty(n, *spec.block_shape)",
        )


def _page_table(page_ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(page_ids, dtype=torch.long).reshape(-1)
    return ids.to(device)


def _spans(spec: KVSpec, layout: PagedLayout, num_blocks: int, num_pages_given: int) -> tuple[int, int]:
    """(pages_per_block, blocks_per_page); exactly one of them is > 1 unless sizes are equal."""
    if spec.block_tokens >= layout.page_tokens:
        ppb = spec.block_tokens // layout.page_tokens
        if num_pages_given < num_blocks * ppb:
            raise InvalidArgument(f"{num_blocks} blocks need {num_blocks * ppb} pages, got {num_pages_given}")
        return ppb, 1
    bpp = layout.page_tokens // spec.block_tokens
    if num_pages_given * bpp < num_blocks:
        raise InvalidArgument(f"{num_blocks} blocks need {-(-num_blocks // bpp)} pages, got {num_pages_given}")
    return 1, bpp


def _auto_chunk(spec: KVSpec, layout: PagedLayout, cache: torch.Tensor, chunk_bytes: int) -> int:
    per_block = spec.kv_factor * spec.block_tokens * layout.num_kv_heads * spec.head_dim * cache.element_size()
    return max(1, chunk_bytes // per_block)


#: Same-size integer dtypes, so numpy (which has no bf16/fp8) can move the raw elements.
_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _write_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[rows] = src`` for 2-D contiguous tensors.

    On CPU through numpy: its fancy-index assignment copies whole rows with memcpy, about 3x
    faster than torch's ``index_copy_`` on this machine (measured in docs/engine.md). Other
    devices use ``index_copy_``.
    """
    if dst.device.type == "cpu":
        raw = _RAW[dst.element_size()]
        dst.view(raw).numpy()[rows.numpy()] = src.view(raw).numpy()
    else:
        dst.index_copy_(0, rows, src)


STRATEGIES = ("auto", "direct", "staged")


def _direct(strategy: str, cache: torch.Tensor) -> bool:
    if strategy not in STRATEGIES:
        raise InvalidArgument(f"strategy {strategy!r} is not one of {STRATEGIES}")
    if strategy == "direct" and cache.device.type != "cpu":
        raise InvalidArgument("the direct strategy runs on CPU tensors only", hint="use 'auto' or 'staged'")
    return strategy == "direct" or (strategy == "auto" and cache.device.type == "cpu")


def _token_view(pages: torch.Tensor, layout: PagedLayout, n_pages: int, kvf: int) -> torch.Tensor:
    """Gathered pages [kv * n_pages, page elems] -> [n_pages_tokens..] as [kv, heads, tokens, dim] view."""
    h, p, d = layout.num_kv_heads, layout.page_tokens, layout.head_dim
    if layout.order == "NHD":  # [kv, n, tok, h, d] -> [kv, h, n, tok, d]
        return pages.view(kvf, n_pages, p, h, d).permute(0, 3, 1, 2, 4)
    return pages.view(kvf, n_pages, h, p, d).permute(0, 2, 1, 3, 4)


def gather_blocks(
    spec: KVSpec,
    layout: PagedLayout,
    kv_caches: Sequence[torch.Tensor],
    page_ids: torch.Tensor | Sequence[int],
    out: torch.Tensor,
    num_blocks: int,
    *,
    chunk_blocks: int | None = None,
    strategy: str = "auto",
) -> None:
    """Copy ``num_blocks`` consecutive blocks of a request from the paged cache into ``out``.

    ``page_ids`` is the request's block table (engine page ids in token order). ``out`` is
    ``[>=num_blocks, *spec.block_shape]``; only this layout's head range is written.
    ``strategy``: "direct" (one pass: ``index_select`` straight into a strided view of the
    blocks, per layer and page slot; CPU), "staged" (rows into a scratch, then one transpose
    copy; used on other devices), "auto" picks by device.
    """
    num_pages = check_caches(spec, layout, kv_caches)
    _block_view(out, spec, num_blocks)
    if num_blocks == 0:
        return
    table = _page_table(page_ids, kv_caches[0].device)
    ppb, bpp = _spans(spec, layout, num_blocks, table.numel())
    kvf, h0, hn = spec.kv_factor, layout.head_start, layout.num_kv_heads
    t, d = spec.block_tokens, spec.head_dim
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= num_pages):
        raise InvalidArgument(f"page ids must lie in [0, {num_pages})")
    if _direct(strategy, kv_caches[0]) and bpp == 1:
        p = layout.page_tokens
        slots = table[: num_blocks * ppb].view(num_blocks, ppb)
        for layer, cache in enumerate(kv_caches):
            for j in range(ppb):  # page slot j of every block, one pass, no scratch
                dst = out[:num_blocks, layer, :, h0 : h0 + hn, j * p : (j + 1) * p]  # [n, kv, hn, p, d]
                view = dst.permute(1, 0, 3, 2, 4) if layout.order == "NHD" else dst.permute(1, 0, 2, 3, 4)
                torch.index_select(cache, 1, slots[:, j], out=view)
        return
    row = layout.page_tokens * hn * d
    chunk_blocks = chunk_blocks or _auto_chunk(spec, layout, kv_caches[0], GATHER_CHUNK_BYTES)
    max_pages = kvf * (chunk_blocks * ppb if bpp == 1 else chunk_blocks // bpp + 2)
    scratch = torch.empty(max_pages, row, dtype=kv_caches[0].dtype, device=kv_caches[0].device)
    for s in range(0, num_blocks, chunk_blocks):
        e = min(num_blocks, s + chunk_blocks)
        n = e - s
        if bpp == 1:
            pages = table[s * ppb : e * ppb]
        else:
            pages = table[s // bpp : (e - 1) // bpp + 1]
        n_pages = pages.numel()
        idx = torch.cat([pages + k * num_pages for k in range(kvf)])
        for layer, cache in enumerate(kv_caches):
            got = scratch[: idx.numel()]
            torch.index_select(cache.view(kvf * num_pages, row), 0, idx, out=got)
            dst = out[s:e, layer, :, h0 : h0 + hn]  # [n, kv, hn, t, d]
            if bpp == 1:  # one copy: [kv, n, ppb, (page dims)] -> [n, kv, hn, ppb, page, d]
                if layout.order == "NHD":
                    src = got.view(kvf, n, ppb, layout.page_tokens, hn, d).permute(1, 0, 4, 2, 3, 5)
                else:
                    src = got.view(kvf, n, ppb, hn, layout.page_tokens, d).permute(1, 0, 3, 2, 4, 5)
                dst.unflatten(3, (ppb, layout.page_tokens)).copy_(src)
            else:
                toks = _token_view(got, layout, n_pages, kvf).reshape(kvf, hn, n_pages * layout.page_tokens, d)
                first_tok = (s % bpp) * t
                toks = toks[:, :, first_tok : first_tok + n * t]
                dst.copy_(toks.reshape(kvf, hn, n, t, d).permute(2, 0, 1, 3, 4))


def scatter_blocks(
    spec: KVSpec,
    layout: PagedLayout,
    blocks: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    page_ids: torch.Tensor | Sequence[int],
    num_blocks: int,
    *,
    chunk_blocks: int | None = None,
    strategy: str = "auto",
) -> None:
    """Write ``num_blocks`` canonical blocks into the request's pages (this layout's heads only).

    ``strategy`` as for ``gather_blocks``: "direct" writes each page slot of every block with
    one numpy fancy-index assignment from a strided view (CPU only); "staged" transposes a chunk
    into page order first, then writes whole page rows.

    When one engine page holds several pool blocks, a page is written only where its tokens
    are covered by the given blocks; the rest of the page is left as it was.
    """
    num_pages = check_caches(spec, layout, kv_caches)
    _block_view(blocks, spec, num_blocks)
    if num_blocks == 0:
        return
    if blocks.dtype != kv_caches[0].dtype:
        raise SpecMismatch(f"blocks have dtype {blocks.dtype}, the cache holds {kv_caches[0].dtype}")
    device = kv_caches[0].device
    table = _page_table(page_ids, device)
    ppb, bpp = _spans(spec, layout, num_blocks, table.numel())
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= num_pages):
        raise InvalidArgument(f"page ids must lie in [0, {num_pages})")
    kvf, h0, hn = spec.kv_factor, layout.head_start, layout.num_kv_heads
    t, d, p = spec.block_tokens, spec.head_dim, layout.page_tokens
    src_all = blocks.to(device) if blocks.device != device else blocks
    if _direct(strategy, kv_caches[0]) and bpp == 1:
        raw = _RAW[blocks.element_size()]
        slots = table[: num_blocks * ppb].view(num_blocks, ppb).numpy()
        for layer, cache in enumerate(kv_caches):
            dst_np = cache.view(raw).numpy()
            src_np = src_all[:num_blocks, layer, :, h0 : h0 + hn].view(raw).numpy()  # [n, kv, hn, t, d]
            for j in range(ppb):
                part = src_np[:, :, :, j * p : (j + 1) * p]  # [n, kv, hn, p, d]
                if layout.order == "NHD":
                    dst_np[:, slots[:, j]] = part.transpose(1, 0, 3, 2, 4)  # [kv, n, p, hn, d]
                else:
                    dst_np[:, slots[:, j]] = part.transpose(1, 0, 2, 3, 4)  # [kv, n, hn, p, d]
        return
    chunk_blocks = chunk_blocks or _auto_chunk(spec, layout, kv_caches[0], SCATTER_CHUNK_BYTES)
    scratch = torch.empty(kvf * chunk_blocks * ppb * p * hn * d, dtype=blocks.dtype, device=device)
    for s in range(0, num_blocks, chunk_blocks):
        e = min(num_blocks, s + chunk_blocks)
        n = e - s
        for layer, cache in enumerate(kv_caches):
            src = src_all[s:e, layer, :, h0 : h0 + hn]  # [n, kv, hn, t, d]
            if bpp == 1:
                pages = table[s * ppb : e * ppb]
                split = src.unflatten(3, (ppb, p))  # [n, kv, hn, ppb, p, d]
                staged = scratch[: kvf * n * ppb * p * hn * d]
                if layout.order == "NHD":  # -> [kv, n, ppb, p, hn, d] in the scratch
                    staged.view(kvf, n, ppb, p, hn, d).copy_(split.permute(1, 0, 3, 4, 2, 5))
                else:  # -> [kv, n, ppb, hn, p, d]
                    staged.view(kvf, n, ppb, hn, p, d).copy_(split.permute(1, 0, 3, 2, 4, 5))
                rows = torch.cat([pages + k * num_pages for k in range(kvf)])
                _write_rows(cache.view(kvf * num_pages, -1), rows, staged.view(kvf * n * ppb, -1))
            else:
                tokens = src.permute(1, 2, 0, 3, 4).reshape(kvf, hn, n * t, d)  # [kv, hn, tok, d]
                for b in range(s, e):  # sub-page blocks: write each block's token slice of its page
                    page = int(table[b // bpp])
                    tok0 = (b % bpp) * t
                    blk = tokens[:, :, (b - s) * t : (b - s + 1) * t]
                    if layout.order == "NHD":
                        cache[:, page, tok0 : tok0 + t].copy_(blk.permute(0, 2, 1, 3))
                    else:
                        cache[:, page, :, tok0 : tok0 + t].copy_(blk)


def convert_order(cache: torch.Tensor, src_order: str, dst_order: str) -> torch.Tensor:
    """NHD <-> HND of one layer's cache ``[kv, pages, ...]``; a new contiguous tensor."""
    if src_order not in ORDERS or dst_order not in ORDERS:
        raise InvalidArgument(f"orders must be among {ORDERS}, got {src_order!r} -> {dst_order!r}")
    if cache.dim() != 5:
        raise InvalidArgument(f"a layer cache is 5-D [kv, pages, a, b, head_dim], got {tuple(cache.shape)}")
    if src_order == dst_order:
        return cache.clone()
    return cache.transpose(2, 3).contiguous()


def blocks_to_tokens(blocks: torch.Tensor, layer: int) -> torch.Tensor:
    """One layer of ``[n, *block_shape]`` blocks as ``[kv, heads, n * block_tokens, head_dim]`` (a copy)."""
    n, _, kvf, h, t, d = blocks.shape
    return blocks[:, layer].permute(1, 2, 0, 3, 4).reshape(kvf, h, n * t, d)


def tokens_to_blocks(tokens: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    """Inverse of ``blocks_to_tokens``: ``[kv, heads, n * block_tokens, head_dim]`` into ``out[:, layer]``."""
    n, _, kvf, h, t, d = out.shape
    if tuple(tokens.shape) != (kvf, h, n * t, d):
        raise InvalidArgument(f"tokens shape {tuple(tokens.shape)} != {(kvf, h, n * t, d)}")
    out[:, layer].copy_(tokens.reshape(kvf, h, n, t, d).permute(2, 0, 1, 3, 4))
