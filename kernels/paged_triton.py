"""Triton kernels for the paged-KV gather (engine pages -> canonical pool blocks) and scatter.

Why a kernel: on a GPU the torch path of ``kvpool.kernels.paged`` ("staged") makes two passes
over the bytes (page rows into a scratch, then a transposing copy) and several launches per
chunk and layer. These kernels move each (block, k|v, head) tile of ``block_tokens x head_dim``
elements in one pass: every token looks up its page in the block table and its address is
computed from the tensors' strides, so one kernel covers

* page size vs pool block size both ways (``block_tokens // page_tokens`` pages per block, or
  ``page_tokens // block_tokens`` blocks per page: token ``i`` of the request lives in page
  ``table[i // page_tokens]`` at slot ``i % page_tokens``; a scatter writes only the tokens of
  the given blocks, so the rest of a shared page is left as it was);
* NHD and HND engine layouts (only the slot and head strides swap);
* a TP rank's contiguous head range (``head_start``; the other heads of ``out`` are untouched);
* non-contiguous tensors (every address comes from the strides);
* every dtype: the kernels copy bits, never values. Each tensor is viewed as the integer type
  of its element size (int8/16/32/64), so fp16, bf16, fp32, fp8 and int8 all move exactly.

One launch per layer (engines hand over one tensor per layer). Page ids are int64 and all
address arithmetic is int64, so caches over 2**31 elements per layer are addressed correctly.

Triton is imported lazily: this module imports without it, and ``available`` says whether the
kernels can run on a device. On CPU tensors they run only under Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is imported), which is how they are tested against
the torch reference (tests/unit/test_kernels_triton_interp.py); ``kvpool.kernels.paged`` never
picks them for CPU tensors on its own. They have not yet run on a GPU: see docs/engine.md.

Duplicate page ids in one scatter's table race (the torch CPU path lets the last write win);
block tables of a request never repeat a page.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Sequence
from typing import Any

import torch

#: Same-size integer dtypes: the kernels move raw elements, so they work for every KV dtype.
_RAW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: Elements per program tile (``BLOCK_T x BLOCK_D``); 4096 fp16 elements = 8 KiB per program.
TILE_ELEMS = 4096


def installed() -> bool:
    """Whether the ``triton`` package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs these kernels in its CPU interpreter (``TRITON_INTERPRET=1`` when
    triton was imported). Asked of the jitted kernel itself (``triton.jit`` returns an
    ``InterpretedFunction`` then), which holds across triton 3.x releases whether or not they
    have ``triton.knobs``."""
    if not installed():
        return False
    move, _ = _kernels()
    return type(move).__name__ == "InterpretedFunction"


def available(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of ``device``: CUDA with triton installed, or CPU
    under Triton's interpreter."""
    if device.type == "cuda":
        return installed() and torch.cuda.is_available()
    if device.type == "cpu":
        return interpreting()
    return False


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """(the copy kernel, ``triton.next_power_of_2``), built on first use, so that importing
    this module needs no triton.

    Cached for the process: a jitted function holds only its compiled-code cache, and whether it
    is interpreted is fixed when triton is imported.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def _move(
        cache,
        blocks,
        table,
        kv_factor,
        heads,
        head_start,
        page_tokens,
        block_tokens,
        head_dim,
        c_kv,
        c_page,
        c_slot,
        c_head,
        c_dim,
        b_blk,
        b_kv,
        b_head,
        b_tok,
        b_dim,
        SCATTER: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # program (pid, tile): block b, k|v, head h of this rank, tokens [tile*BLOCK_T, +BLOCK_T)
        pid = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1).to(tl.int64)
        h = pid % heads
        kv = (pid // heads) % kv_factor
        b = pid // (heads * kv_factor)
        tok = tile * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        dim = tl.arange(0, BLOCK_D).to(tl.int64)
        tok_ok = tok < block_tokens
        req_tok = b * block_tokens + tok  # token index within the request
        page = tl.load(table + req_tok // page_tokens, mask=tok_ok, other=0).to(tl.int64)
        slot = req_tok % page_tokens
        c_off = kv * c_kv + h * c_head + page * c_page + slot * c_slot
        b_off = b * b_blk + kv * b_kv + (head_start + h) * b_head + tok * b_tok
        c_ptr = cache + c_off[:, None] + dim[None, :] * c_dim
        b_ptr = blocks + b_off[:, None] + dim[None, :] * b_dim
        mask = tok_ok[:, None] & (dim < head_dim)[None, :]
        if SCATTER:
            tl.store(c_ptr, tl.load(b_ptr, mask=mask), mask=mask)
        else:
            tl.store(b_ptr, tl.load(c_ptr, mask=mask), mask=mask)

    return _move, triton.next_power_of_2


def _launch(
    *,
    scatter: bool,
    kv_caches: Sequence[torch.Tensor],
    blocks: torch.Tensor,
    table: torch.Tensor,
    num_blocks: int,
    order: str,
    page_tokens: int,
    head_start: int,
    heads: int,
) -> None:
    move, next_pow2 = _kernels()
    _, _, kvf, _, block_tokens, head_dim = blocks.shape
    raw = _RAW[blocks.element_size()]
    blk = blocks.view(raw)
    table = table.to(device=blocks.device, dtype=torch.int64).contiguous()
    block_d = next_pow2(head_dim)
    block_t = max(1, min(next_pow2(block_tokens), TILE_ELEMS // block_d))
    grid = (num_blocks * kvf * heads, -(-block_tokens // block_t))
    slot_dim, head_dim_ax = (2, 3) if order == "NHD" else (3, 2)
    # triton launches on the current CUDA device: make it the tensors' device
    on_device = torch.cuda.device(blocks.device) if blocks.device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        for layer, cache in enumerate(kv_caches):
            c = cache.view(raw)
            dst = blk[:, layer]  # [n, kv, H, t, d] view; its storage offset is in its data pointer
            s = c.stride()
            o = dst.stride()
            move[grid](
                c,
                dst,
                table,
                kvf,
                heads,
                head_start,
                page_tokens,
                block_tokens,
                head_dim,
                s[0],
                s[1],
                s[slot_dim],
                s[head_dim_ax],
                s[4],
                o[0],
                o[1],
                o[2],
                o[3],
                o[4],
                SCATTER=scatter,
                BLOCK_T=block_t,
                BLOCK_D=block_d,
            )


def gather(
    kv_caches: Sequence[torch.Tensor],
    table: torch.Tensor,
    out: torch.Tensor,
    num_blocks: int,
    *,
    order: str,
    page_tokens: int,
    head_start: int,
    heads: int,
) -> None:
    """``out[:num_blocks, :, :, head_start:head_start + heads]`` from the paged caches.

    The caller (``kvpool.kernels.paged.gather_blocks``) has checked shapes, dtypes and page ids;
    ``out`` is ``[n, layers, kv, all heads, block_tokens, head_dim]`` on the caches' device with
    the caches' element size.
    """
    _launch(
        scatter=False,
        kv_caches=kv_caches,
        blocks=out,
        table=table,
        num_blocks=num_blocks,
        order=order,
        page_tokens=page_tokens,
        head_start=head_start,
        heads=heads,
    )


def scatter(
    blocks: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    table: torch.Tensor,
    num_blocks: int,
    *,
    order: str,
    page_tokens: int,
    head_start: int,
    heads: int,
) -> None:
    """The inverse of ``gather``: write this head range of ``num_blocks`` blocks into their pages.

    Layers are launched in order on the current stream, so one tensor passed for two layers
    ends up holding the last layer's bytes, as on the CPU path.
    """
    _launch(
        scatter=True,
        kv_caches=kv_caches,
        blocks=blocks,
        table=table,
        num_blocks=num_blocks,
        order=order,
        page_tokens=page_tokens,
        head_start=head_start,
        heads=heads,
    )
