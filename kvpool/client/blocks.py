"""Moving block bytes between a caller's arrays and a node's mapped arena.

Shared by the sync and async clients. Arrays come in as numpy arrays or CPU torch
tensors of the spec's dtype and shape ``[n, *spec.block_shape]``; they are viewed (never
copied) as ``[n, block_bytes]`` uint8 rows. Writers checksum the source rows right
before the copy; readers checksum the destination rows right after it, so what the
caller ends up holding is what was verified.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.core.arena_map import PutWindow
from kvpool.core.checksum import checksum64
from kvpool.core.errors import InvalidArgument
from kvpool.core.spec import KVSpec

log = logging.getLogger("kvpool.client")

_TORCH_DTYPE_NAMES = {
    "torch.float32": "float32",
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float8_e4m3fn": "float8_e4m3fn",
    "torch.float8_e5m2": "float8_e5m2",
    "torch.int8": "int8",
    "torch.uint8": "uint8",
}


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage")


def block_rows(blocks: Any, spec: KVSpec, what: str, writable: bool = False) -> np.ndarray:
    """View ``blocks`` ([n, *block_shape], spec dtype) as a uint8 array [n, block_bytes]."""
    if not hasattr(blocks, "shape"):
        raise InvalidArgument(
            f"{what} is a {type(blocks).__name__}; pass a numpy array or a CPU torch tensor of shape "
            f"[n, {', '.join(map(str, spec.block_shape))}] and dtype {spec.dtype}"
        )
    shape = tuple(blocks.shape)
    if len(shape) != 6 or shape[1:] != spec.block_shape:
        raise InvalidArgument(
            f"{what} has shape {shape}; expected [n, {', '.join(map(str, spec.block_shape))}] "
            f"(n blocks of [layers, k|v, kv_heads, block_tokens, head_dim]) for {spec.describe()}"
        )
    if _is_torch(blocks):
        dtype_name = _TORCH_DTYPE_NAMES.get(str(blocks.dtype), str(blocks.dtype))
        if dtype_name != spec.dtype:
            raise InvalidArgument(f"{what} has dtype {blocks.dtype}; the pool namespace holds {spec.dtype}")
        if blocks.device.type != "cpu":
            raise InvalidArgument(
                f"{what} is on {blocks.device}; PoolClient moves host memory",
                hint="use the engine connector (it stages device pages through pinned host buffers)",
            )
        if not blocks.is_contiguous():
            raise InvalidArgument(f"{what} is not contiguous", hint="call .contiguous() first")
        import torch  # only reached with a torch tensor in hand

        arr = blocks.detach().reshape(-1).view(torch.uint8).numpy()
    else:
        arr = np.asarray(blocks)
        if arr.dtype != spec.numpy_dtype:
            raise InvalidArgument(
                f"{what} has dtype {arr.dtype}; the pool namespace holds {spec.dtype} (numpy holder {spec.numpy_dtype})"
            )
        if not arr.flags.c_contiguous:
            raise InvalidArgument(f"{what} is not C-contiguous", hint="use np.ascontiguousarray")
        arr = arr.reshape(-1).view(np.uint8)
    if writable and not arr.flags.writeable:
        raise InvalidArgument(f"{what} is read-only")
    return arr.reshape(shape[0], spec.block_bytes)


def write_rows(
    arena: np.ndarray | PutWindow, rows: np.ndarray, indices: Sequence[int], offsets: Sequence[int]
) -> list[int]:
    """Copy rows[indices[i]] into the arena at offsets[i] (a client writes through its put's
    window, ``SharedArena.put_window``); return the source checksums."""
    block_bytes = rows.shape[1]
    checksums: list[int] = []
    for index, offset in zip(indices, offsets, strict=True):
        src = rows[index]
        checksums.append(checksum64(src))
        arena[offset : offset + block_bytes] = src
    return checksums


def read_rows(arena: np.ndarray, dst: np.ndarray, offsets: Sequence[int], checksums: Sequence[int], source: str) -> int:
    """Copy arena blocks into dst rows and verify each; return how many leading rows are good.

    A row that fails its checksum and every row after it are treated as misses: the
    caller recomputes them. Nothing after a bad row is trusted or reported as read.
    """
    block_bytes = dst.shape[1]
    for i, (offset, expected) in enumerate(zip(offsets, checksums, strict=True)):
        row = dst[i]
        np.copyto(row, arena[offset : offset + block_bytes])
        if checksum64(row) != expected:
            log.warning("block %d from %s failed its checksum (offset %d): treated as a miss", i, source, offset)
            return i
    return len(offsets)
