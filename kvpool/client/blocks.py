"""Moving block bytes between a caller's arrays and a node's mapped arena.

Shared by the sync and async clients. Arrays come in as numpy arrays or CPU torch
tensors of the spec's dtype and shape ``[n, *spec.block_shape]``; they are viewed (never
copied) as ``[n, block_bytes]`` uint8 rows. Every copy computes the checksum of the bytes it
stores in the same pass (``kvpool.core.checksum.copy_checksum_rows``): a writer's checksum is
that of what landed in its slot, a reader's that of what the caller ends up holding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np

from kvpool.core.arena_map import PutWindow
from kvpool.core.checksum import STREAM_MIN_BYTES, checksum_rows, copy_checksum_rows
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


#: bytes handed to an engine's callback at once (``fill_slots`` / ``use_rows``): its gather or
#: scatter kernel costs tens of microseconds per call and per layer, which 256 KiB pieces
#: would not repay (one call per 2 MiB Llama-3-8B block measured 2x slower than one call per
#: four); 8 MiB still sits in the last-level cache (105 MiB on the bench host) for the
#: checksum right before or after, so each byte still crosses DRAM once.
ENGINE_RUN_BYTES = 8 << 20

#: bytes of adjacent blocks copied by one call (``read_rows`` / ``write_rows``): the copy
#: hashes as it goes (``copy_checksum_rows``), so a run's length only sets how many Python
#: calls a batch costs; a bad block still ends the read at that block.
COPY_RUN_BYTES = 8 << 20


def adjacent_runs(
    offsets: Sequence[int],
    indices: Sequence[int],
    block_bytes: int,
    most_bytes: int | None = None,
    split_bytes: int = 0,
) -> list[tuple[int, int]]:
    """``(first, count)`` runs of positions whose arena offsets and row indices both follow
    one another (block k+1 right after block k on both sides), each at most ``most_bytes``
    long (``COPY_RUN_BYTES`` when None) unless one block alone is larger: small blocks of
    one batch that the allocator placed side by side are copied in one call, not one each.
    With ``split_bytes`` (a per-tenant arena's segment size) no run crosses a multiple of it:
    a put window maps each segment on its own, so two slots either side of a segment edge
    are adjacent in the arena but not in one mapping."""
    most = max(1, (COPY_RUN_BYTES if most_bytes is None else most_bytes) // block_bytes)
    n = len(offsets)
    if len(indices) != n:
        raise InvalidArgument(f"{n} slot offsets for {len(indices)} rows")
    if n == 0:
        return []
    # numpy, not a loop per block: a 256 MiB put of 16 KiB blocks has 16,384 of them
    off = np.asarray(offsets, dtype=np.int64)
    idx = np.asarray(indices, dtype=np.int64)
    follows = np.zeros(n, dtype=np.bool_)  # block k goes on the run of block k - 1
    follows[1:] = (off[1:] == off[:-1] + block_bytes) & (idx[1:] == idx[:-1] + 1)
    if split_bytes:  # a run never crosses a multiple of split_bytes
        follows[1:] &= off[1:] // split_bytes == off[:-1] // split_bytes
    starts = np.flatnonzero(~follows).tolist()
    runs: list[tuple[int, int]] = []
    for start, end in zip(starts, [*starts[1:], n], strict=True):  # chains, cut every `most` blocks
        runs.extend((first, min(most, end - first)) for first in range(start, end, most))
    return runs


def _split_bytes(arena: np.ndarray | PutWindow) -> int:
    """Where runs written through ``arena`` must break (``adjacent_runs``)."""
    return arena.segment_bytes if isinstance(arena, PutWindow) else 0


def _slot_bytes(arena: np.ndarray | PutWindow, start: int, stop: int) -> np.ndarray:
    if isinstance(arena, PutWindow):
        return arena.view_of(start, stop)
    return arena[start:stop]


def write_rows(
    arena: np.ndarray | PutWindow, rows: np.ndarray, indices: Sequence[int], offsets: Sequence[int]
) -> list[int]:
    """Copy rows[indices[i]] into the arena at offsets[i] (a client writes through its put's
    window, ``SharedArena.put_window``); return each slot's checksum, computed in the same
    pass as its copy (module docstring). Adjacent slots of adjacent rows are one copy."""
    block_bytes = rows.shape[1]
    stream = len(offsets) * block_bytes >= STREAM_MIN_BYTES
    copies = []  # (slots, rows) of each run, all checked before any byte is written
    spans = []  # the arena bytes [start, stop) of each
    for first, count in adjacent_runs(offsets, indices, block_bytes, split_bytes=_split_bytes(arena)):
        offset, index = offsets[first], indices[first]
        target = _slot_bytes(arena, offset, offset + count * block_bytes).reshape(count, block_bytes)
        copies.append((target, rows[index : index + count]))
        spans.append((offset, offset + count * block_bytes))
    # a keyed window is open to this thread for each copy call only (no Python runs in it); a
    # pipelined one waits there for the copy's pages and shuts the pieces it filled
    window = arena if isinstance(arena, PutWindow) else None
    checksums: list[int] = []
    for (target, source), (start, stop) in zip(copies, spans, strict=True):
        with window.writing(start, stop) if window is not None else nullcontext():
            digests = copy_checksum_rows(target, source, stream=stream)
        checksums.extend(digests)
    return checksums


def read_rows(arena: np.ndarray, dst: np.ndarray, offsets: Sequence[int], checksums: Sequence[int], source: str) -> int:
    """Copy arena blocks into dst rows and verify each; return how many leading rows are good.

    The copy and the check are one pass (``copy_checksum_rows``; a batch larger than the
    cache is stored past it); adjacent blocks are copied together. A row that fails its
    checksum and every row after it are treated as misses: the caller recomputes them.
    Nothing after a bad row is trusted or reported as read.
    """
    block_bytes = dst.shape[1]
    stream = len(offsets) * block_bytes >= STREAM_MIN_BYTES
    for first, count in adjacent_runs(offsets, range(len(offsets)), block_bytes):
        offset = offsets[first]
        source_rows = arena[offset : offset + count * block_bytes].reshape(count, block_bytes)
        got = copy_checksum_rows(dst[first : first + count], source_rows, stream=stream)
        for k, digest in enumerate(got):
            if digest != checksums[first + k]:
                i = first + k
                log.warning(
                    "block %d from %s failed its checksum (offset %d): treated as a miss", i, source, offsets[i]
                )
                return i
    return len(offsets)


BlockFill = Callable[[int, int, np.ndarray], None]
"""``fill(first, count, rows)``: write blocks ``first .. first + count - 1`` of a put (positions
in its hashes) into ``rows``, a writable uint8 ``[count, block_bytes]`` view of their arena
slots; the bytes are checksummed right after the call returns (still in cache). Finish every
write before returning and keep no reference to ``rows``: the slots stop being writable when the
put's window closes, and a write after that is a SIGSEGV (docs/security.md, put windows)."""

BlockUse = Callable[[int, int, np.ndarray], None]
"""``use(first, count, rows)``: read leased blocks ``first .. first + count - 1`` (positions in
the hashes asked for) from ``rows``, a read-only uint8 ``[count, block_bytes]`` view of the
arena, already verified; the view is valid only during the call (the lease ends after)."""


def fill_slots(
    window: np.ndarray | PutWindow, block_bytes: int, indices: Sequence[int], offsets: Sequence[int], fill: BlockFill
) -> list[int]:
    """Let ``fill`` write each put slot in place and checksum it right after: the caller
    (an engine connector gathering its pages) writes straight into the arena, no staging
    buffer, and each byte crosses memory once on the way in. Slots that follow one another
    in the arena (and in ``indices``) are handed out together, up to ``ENGINE_RUN_BYTES``
    (still in the last-level cache for the checksum) unless one block alone is larger."""
    checksums: list[int] = []
    for first, count in adjacent_runs(offsets, indices, block_bytes, ENGINE_RUN_BYTES, _split_bytes(window)):
        offset = offsets[first]
        rows = _slot_bytes(window, offset, offset + count * block_bytes).reshape(count, block_bytes)
        fill(int(indices[first]), count, rows)
        checksums.extend(checksum_rows(rows))
    return checksums


def use_rows(
    arena: np.ndarray, block_bytes: int, offsets: Sequence[int], checksums: Sequence[int], use: BlockUse, source: str
) -> int:
    """Verify leased blocks and hand each verified run to ``use`` straight from the arena;
    return how many leading blocks were good. Each run (adjacent blocks, at most
    ``ENGINE_RUN_BYTES`` unless one block is larger) is checksummed first and read by ``use``
    right after, while in cache; a leased block cannot change under its lease (the client maps
    it read-only, the node never rewrites it), so what ``use`` reads is what was verified.
    The first bad block and everything after it are misses (``read_rows``)."""
    for first, count in adjacent_runs(offsets, range(len(offsets)), block_bytes, ENGINE_RUN_BYTES):
        offset = offsets[first]
        rows = arena[offset : offset + count * block_bytes].reshape(count, block_bytes)
        got = checksum_rows(rows)
        good = 0
        while good < count and got[good] == checksums[first + good]:
            good += 1
        if good:
            use(first, good, rows[:good])
        if good < count:
            i = first + good
            log.warning("block %d from %s failed its checksum (offset %d): treated as a miss", i, source, offsets[i])
            return i
    return len(offsets)
