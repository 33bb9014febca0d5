"""int8 / fp8 transfer compression of canonical blocks, with a stated error bound.

Scales are per (block, layer, k|v, kv_head): one absmax over that head's
``block_tokens x head_dim`` values, so an outlier head does not flatten every other head.

Error bounds (``x`` an input value, ``a`` the absmax of its group, ``x'`` the decoded value,
computed in float32; decoding into bf16/fp16 adds that dtype's own rounding of ``x'``):

* int8: ``q = round(x / s)``, ``s = a / 127``. ``|x - x'| <= s / 2 = a / 254``.
* fp8 e4m3fn: ``s = a / 448`` (448 = largest finite e4m3). e4m3 has 3 mantissa bits, so a
  value in the normal range (``|x / s| >= 2**-6``) is off by at most half a unit in the last
  place: ``|x - x'| <= 2**-4 * |x|``; below it the subnormal step is ``2**-9``, so
  ``|x - x'| <= 2**-10 * s``. Together: ``|x - x'| <= max(2**-4 * |x|, 2**-10 * s)``.

Both bounds are checked by property tests (tests/unit/test_kernels_quant.py). Compression
halves (int8/fp8 from bf16) or quarters (from fp32) the bytes on the wire; it is lossy, so
a pool namespace holding compressed blocks must use its own KVSpec (dtype "int8" or
"float8_e4m3fn") so readers never mistake them for exact KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpool.core.errors import InvalidArgument

CODECS = ("int8", "fp8")
INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
TINY = 1e-30  # an all-zero group gets this scale instead of 0 (no division by zero)


@dataclass(frozen=True)
class Compressed:
    """Quantised blocks ``[n, layers, kv, heads, tokens, dim]`` plus float32 scales ``[n, layers, kv, heads]``."""

    codec: str
    values: torch.Tensor
    scales: torch.Tensor
    source_dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.scales.numel() * 4


def _check(blocks: torch.Tensor) -> None:
    if blocks.dim() != 6:
        raise InvalidArgument(f"expected blocks [n, layers, kv, heads, tokens, dim], got {tuple(blocks.shape)}")
    if not blocks.is_floating_point():
        raise InvalidArgument(f"only floating KV can be compressed, got {blocks.dtype}")


def compress(blocks: torch.Tensor, codec: str) -> Compressed:
    """Quantise ``blocks`` with ``codec`` ("int8" or "fp8"); see the module docstring for the bound."""
    _check(blocks)
    if codec not in CODECS:
        raise InvalidArgument(f"codec {codec!r} is not one of {CODECS}")
    x = blocks.float()
    absmax = x.abs().amax(dim=(-2, -1))
    limit = INT8_MAX if codec == "int8" else FP8_E4M3_MAX
    scales = torch.clamp(absmax / limit, min=TINY)
    scaled = x / scales[..., None, None]
    if codec == "int8":
        values = torch.round(scaled).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        values = scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return Compressed(codec=codec, values=values, scales=scales, source_dtype=blocks.dtype)


def decompress(packed: Compressed, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Decode to ``dtype`` (default: the dtype that was compressed)."""
    x = packed.values.float() * packed.scales[..., None, None]
    return x.to(dtype or packed.source_dtype)


def error_bound(blocks: torch.Tensor, codec: str) -> torch.Tensor:
    """The documented per-element bound on ``|x - decompress(compress(x))|`` (float32 decode)."""
    x = blocks.float()
    absmax = x.abs().amax(dim=(-2, -1), keepdim=True)
    if codec == "int8":
        return (absmax / (2 * INT8_MAX)).expand_as(x)
    scale = torch.clamp(absmax / FP8_E4M3_MAX, min=TINY)
    return torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
