"""What vLLM's KV cache looks like in memory, read from what vLLM reports, never assumed.

vLLM (0.32) hands a connector one tensor per attention layer: a *logical* ``[B, H, N, C]``
view (blocks, kv heads, tokens, content) whose strides follow the resolved
``KVCacheLayout`` (``LBNHC``, ``LBHNC``, ...), so the physical order is already in the
strides. What the content ``C`` holds is the attention backend's business:

* ``"token"`` packing (FlashAttention, FlashInfer, Triton, FlexAttention): one cell per
  (block, head, token) holds ``K[head_size] | V[head_size]``; the backends split it with
  ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``.
* ``"page"`` packing (the CPU backend, ``CPU_ATTN``): the ``N x C`` bytes of one (block,
  head) are ``K[N][head_size]`` followed by ``V[N][head_size]``; the backend views the
  tensor as ``[B, H, 2N, head_size]`` and chunks dim 2 in two.

``kv_view`` turns either into a strided ``[2, B, H, N, head_size]`` view of the same
memory (no copy), which ``kvpool.kernels.paged`` reads and writes as an ``HND`` paged
cache. When vLLM splits a manager block into kernel blocks (``B = num_blocks * ratio``),
``manager_to_kernel_pages`` maps the scheduler's block ids to kernel page ids.

No vLLM import here: the checks run on plain values, so they are unit-tested without vLLM
and refuse an unknown layout with a message instead of moving the wrong bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.core.errors import InvalidArgument, SpecMismatch

#: Attention backends whose cache content layout kvpool knows, by ``get_name()``.
BACKEND_PACKING: dict[str, str] = {
    "CPU_ATTN": "page",
    "FLASH_ATTN": "token",
    "FLASHINFER": "token",
    "TRITON_ATTN": "token",
    "FLEX_ATTENTION": "token",
}
PACKINGS = ("page", "token")


@dataclass(frozen=True)
class VllmCacheLayout:
    """One engine's per-layer cache, as far as the pool needs to know it.

    ``page_tokens`` is the tokens of one *kernel* block (a page of the registered
    tensors); ``pages_per_manager_block`` of them make one block id of the scheduler.
    """

    backend: str
    packing: str
    num_kv_heads: int  # heads in this rank's tensors
    head_dim: int
    page_tokens: int
    pages_per_manager_block: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.packing not in PACKINGS:
            raise InvalidArgument(f"packing {self.packing!r} is not one of {PACKINGS}")
        for name in ("num_kv_heads", "head_dim", "page_tokens", "pages_per_manager_block"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"VllmCacheLayout.{name} must be positive, got {getattr(self, name)}")

    @property
    def manager_block_tokens(self) -> int:
        return self.page_tokens * self.pages_per_manager_block


def packing_for_backend(backend_name: str) -> str:
    """The content packing of a vLLM attention backend, or a refusal that names the known ones."""
    packing = BACKEND_PACKING.get(backend_name)
    if packing is None:
        raise SpecMismatch(
            f"vLLM attention backend {backend_name!r} stores KV in a layout kvpool does not know",
            hint=f"use one of {sorted(BACKEND_PACKING)} (VLLM_ATTENTION_BACKEND), or run without the pool",
        )
    return packing


def describe_caches(
    backend_name: str, caches: Sequence[torch.Tensor], num_manager_blocks: int, head_dim: int
) -> VllmCacheLayout:
    """Read the layout from the registered tensors and refuse anything that is not plain
    dense K/V of ``head_dim`` (quantised-with-scales, padded or MLA caches)."""
    packing = packing_for_backend(backend_name)
    if not caches:
        raise SpecMismatch("vLLM registered no attention KV caches", hint="run this model without the pool")
    first = caches[0]
    for i, cache in enumerate(caches):
        if cache.dim() != 4:
            raise SpecMismatch(
                f"vLLM layer {i} cache has shape {tuple(cache.shape)}; kvpool expects vLLM's [B, H, N, C] view",
                hint="this vLLM version is not supported by this kvpool version",
            )
        if tuple(cache.shape) != tuple(first.shape) or cache.dtype != first.dtype:
            raise SpecMismatch(
                f"vLLM layer {i} cache {tuple(cache.shape)} {cache.dtype} differs from layer 0 "
                f"{tuple(first.shape)} {first.dtype}",
                hint="hybrid or per-layer-sized caches are not supported: run this model without the pool",
            )
    pages, heads, tokens, content = (int(x) for x in first.shape)
    if content != 2 * head_dim:
        raise SpecMismatch(
            f"vLLM cache content is {content} elements per token and head, not K|V of head_size {head_dim}",
            hint="quantised caches with scales, padded head sizes and MLA are not supported",
        )
    if num_manager_blocks <= 0 or pages % num_manager_blocks:
        raise SpecMismatch(f"vLLM cache has {pages} pages, not a multiple of its {num_manager_blocks} blocks")
    for i, cache in enumerate(caches):
        if cache.stride(3) != 1 or (packing == "page" and cache.stride(2) != content):
            raise SpecMismatch(
                f"vLLM layer {i} cache strides {cache.stride()} do not keep a "
                f"{'page' if packing == 'page' else 'cell'} contiguous as backend {backend_name} needs",
                hint="report this layout to the kvpool developers; run without the pool meanwhile",
            )
    return VllmCacheLayout(backend_name, packing, heads, head_dim, tokens, pages // num_manager_blocks, first.dtype)


def kv_view(cache: torch.Tensor, layout: VllmCacheLayout) -> torch.Tensor:
    """``[2, B, H, N, head_dim]`` view (k|v first) of one layer's ``[B, H, N, C]`` tensor."""
    b, h, n, _ = cache.shape
    d = layout.head_dim
    s_b, s_h, s_n, _ = cache.stride()
    if layout.packing == "page":  # per (block, head): K[N][d] then V[N][d]
        strides = (n * d, s_b, s_h, d, 1)
    else:  # per (block, head, token): K[d] then V[d]
        strides = (d, s_b, s_h, s_n, 1)
    return cache.as_strided((2, b, h, n, d), strides, cache.storage_offset())


def manager_to_kernel_pages(block_ids: Sequence[int], pages_per_manager_block: int) -> list[int]:
    """Kernel page ids of scheduler block ids (vLLM splits block b into pages b*r .. b*r+r-1)."""
    r = pages_per_manager_block
    if r == 1:
        return list(block_ids)
    return [b * r + j for b in block_ids for j in range(r)]
