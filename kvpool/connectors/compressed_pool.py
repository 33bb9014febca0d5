"""Transfer compression in front of a pool: int8 / fp8 blocks on the wire and in the pool.

``CompressedPool(inner, spec, codec)`` looks like a pool of exact ``spec`` blocks to a
connector (same ``BlockPool`` methods, ``.spec`` is the exact spec) but stores each block
quantised (``kvpool.kernels.quant``; error bound in its docstring) under its own namespace,
``compressed_spec(spec, codec)``: dtype ``uint8``, shape ``[layers, kv, heads + 1, tokens,
head_dim]``: the extra head of each (layer, k|v) holds the float32 scales of its real heads.
``block_tokens`` is unchanged, so the hash chain cuts the prompt exactly as for exact blocks.
Because the spec differs (dtype, shape and ``+int8``/``+fp8`` in the revision), exact and
compressed blocks never share hashes: a reader of exact KV can never be handed a lossy block.

Size: a bf16 block shrinks to (heads + 1) / (2 * heads) of its bytes (9/16 with 8 kv heads),
an fp32 block to (heads + 1) / (4 * heads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from kvpool.connectors.pool_api import BlockPool, pool_spec
from kvpool.core.errors import InvalidArgument
from kvpool.core.spec import KVSpec
from kvpool.kernels.paged import TORCH_DTYPES
from kvpool.kernels.quant import CODECS, Compressed, compress, decompress

SCALE_BYTES = 4


def compressed_spec(spec: KVSpec, codec: str) -> KVSpec:
    """The namespace spec of ``spec``'s blocks compressed with ``codec``."""
    if codec not in CODECS:
        raise InvalidArgument(f"codec {codec!r} is not one of {CODECS}")
    if spec.dtype not in ("float32", "float16", "bfloat16"):
        raise InvalidArgument(f"only float KV can be compressed, the spec holds {spec.dtype}")
    if spec.kind != "mha":
        raise InvalidArgument("compressed blocks are defined for MHA/GQA specs only")
    if SCALE_BYTES * spec.num_kv_heads > spec.block_tokens * spec.head_dim:
        raise InvalidArgument(
            f"{spec.num_kv_heads} scales do not fit in one head's {spec.block_tokens}x{spec.head_dim} bytes",
            hint="use larger blocks to compress this spec",
        )
    return dataclasses.replace(
        spec,
        dtype="uint8",
        num_kv_heads=spec.num_kv_heads + 1,
        revision=f"{spec.revision}+{codec}-from-{spec.dtype}",
    )


def pack(blocks: torch.Tensor, codec: str) -> torch.Tensor:
    """Exact blocks ``[n, *spec.block_shape]`` -> uint8 ``[n, *compressed_spec.block_shape]``."""
    packed = compress(blocks, codec)
    n, layers, kvf, heads, tokens, dim = blocks.shape
    out = torch.zeros(n, layers, kvf, heads + 1, tokens, dim, dtype=torch.uint8)
    out[:, :, :, :heads] = packed.values.view(torch.uint8)
    scale_bytes = packed.scales.contiguous().view(torch.uint8).view(n, layers, kvf, heads * SCALE_BYTES)
    out[:, :, :, heads].view(n, layers, kvf, tokens * dim)[..., : heads * SCALE_BYTES] = scale_bytes
    return out


def unpack(raw: torch.Tensor, codec: str, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``pack``: uint8 compressed blocks -> decoded blocks of ``dtype``."""
    n, layers, kvf, heads_plus, tokens, dim = raw.shape
    heads = heads_plus - 1
    qdtype = torch.int8 if codec == "int8" else torch.float8_e4m3fn
    values = raw[:, :, :, :heads].contiguous().view(qdtype)
    scale_bytes = raw[:, :, :, heads].reshape(n, layers, kvf, tokens * dim)[..., : heads * SCALE_BYTES].contiguous()
    scales = scale_bytes.view(torch.float32).view(n, layers, kvf, heads)
    return decompress(Compressed(codec, values, scales, dtype), dtype)


class CompressedPool:
    """A ``BlockPool`` of exact ``spec`` blocks that stores them compressed in ``inner``."""

    def __init__(self, inner: BlockPool, spec: KVSpec, codec: str) -> None:
        """``inner``: a pool of the compressed wire spec (``compressed_spec(spec, codec)``); ``codec``: the
        transfer codec (fp8 or int8, see kvpool.kernels.quant).
        """
        self.inner = inner
        self.spec = spec
        self.codec = codec
        self.wire_spec = compressed_spec(spec, codec)
        held = pool_spec(inner)
        if held is not None:
            held.require_same(self.wire_spec, "compressed pool")
        self.dtype = TORCH_DTYPES[spec.dtype]

    def hashes(self, token_ids: Any) -> list[bytes]:
        """The hash chain (the inner pool's: compression does not change block identity within its namespace)."""
        return self.inner.hashes(token_ids)

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks held in the inner pool."""
        return self.inner.lookup(hashes)

    def _tensor(self, blocks: Any, what: str) -> torch.Tensor:
        if not isinstance(blocks, torch.Tensor):
            raise InvalidArgument(f"{what} must be a torch tensor for a compressed pool")
        if tuple(blocks.shape[1:]) != self.spec.block_shape or blocks.dtype != self.dtype:
            raise InvalidArgument(
                f"{what} is {tuple(blocks.shape)} {blocks.dtype}, expected [n, *{self.spec.block_shape}] {self.dtype}"
            )
        return blocks

    def put(self, hashes: Sequence[bytes], blocks: Any) -> Any:
        """Compress ``blocks`` and store them in the inner pool."""
        return self.inner.put(hashes, pack(self._tensor(blocks, "blocks"), self.codec))

    def get_into(self, hashes: Sequence[bytes], out: Any) -> int:
        """Read compressed blocks from the inner pool and decompress them into ``out``; returns how many."""
        out = self._tensor(out, "out")
        raw = torch.empty(len(hashes), *self.wire_spec.block_shape, dtype=torch.uint8)
        got = self.inner.get_into(hashes, raw)
        if got:
            out[:got].copy_(unpack(raw[:got], self.codec, self.dtype))
        return got
