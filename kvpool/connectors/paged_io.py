"""Moving an engine's KV between its own memory and the pool's arena in one copy.

A connector that stages through a private buffer copies every byte twice on the way in
(pages -> buffer, buffer -> arena slot) and twice on the way out. With a pool that exposes
its slots (``SlotPool``: ``PoolClient.stage_put`` / ``read_with``) the connector's gather
writes the canonical blocks straight into the put's arena slots and its scatter reads them
straight from the leased, verified arena bytes: one copy per byte, checksummed while the
bytes are in cache (``kvpool.client.blocks.fill_slots`` / ``use_rows``).

``stage_blocks`` and ``load_blocks`` take a ``write`` / ``read`` callback that sees the blocks
as a ``[count, *spec.block_shape]`` tensor of the engine's dtype, whatever the pool is: for a
pool without slots (``CompressedPool``, a test double) the same callbacks run on a private
buffer and the bytes go through ``put`` / ``get_into``, so a connector has one code path.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvpool.connectors.pool_api import BlockPool, SlotPool, Staged
from kvpool.core.spec import KVSpec

BlocksCallback = Callable[[int, int, torch.Tensor], None]
"""``cb(first, count, blocks)``: blocks ``first .. first + count - 1`` of the call's hashes as a
``[count, *block_shape]`` tensor (the arena's bytes for a ``SlotPool``: valid during the call only)."""

# torch warns that a tensor over a read-only array is writable; the leased arena is mapped
# read-only on purpose and the scatter only reads it (a write would fault, never land)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", module=__name__)


def blocks_tensor(rows: np.ndarray, spec: KVSpec, dtype: torch.dtype) -> torch.Tensor:
    """A ``[count, *spec.block_shape]`` tensor of ``dtype`` over ``rows`` (uint8 ``[count, block_bytes]``), no copy."""
    return torch.from_numpy(rows).view(dtype).view(rows.shape[0], *spec.block_shape)


class BufferedPut:
    """A staged put of a pool without slots: the blocks wait in a private buffer, ``commit`` puts them."""

    def __init__(self, pool: BlockPool, hashes: Sequence[bytes], blocks: torch.Tensor) -> None:
        self._pool, self._hashes, self._blocks = pool, list(hashes), blocks

    @property
    def written_blocks(self) -> int:
        return len(self._hashes)

    def commit(self) -> Any:
        return self._pool.put(self._hashes, self._blocks)

    def abort(self) -> None:
        self._hashes = []


def stage_blocks(
    pool: BlockPool, spec: KVSpec, dtype: torch.dtype, hashes: Sequence[bytes], write: BlocksCallback
) -> Staged | None:
    """Have ``write`` produce the blocks of ``hashes`` in place (arena slots of a ``SlotPool``,
    else a private buffer); ``commit`` the result to make them visible (it may run on another
    thread). None when the pool took nothing (it is down)."""
    if isinstance(pool, SlotPool):
        return pool.stage_put(hashes, lambda first, count, rows: write(first, count, blocks_tensor(rows, spec, dtype)))
    buf = torch.empty(len(hashes), *spec.block_shape, dtype=dtype)  # fully overwritten by ``write``
    write(0, len(hashes), buf)
    return BufferedPut(pool, hashes, buf)


def load_blocks(
    pool: BlockPool, spec: KVSpec, dtype: torch.dtype, hashes: Sequence[bytes], read: BlocksCallback
) -> int:
    """Hand the leading cached, verified blocks of ``hashes`` to ``read`` (straight from the
    arena for a ``SlotPool``, else through a buffer filled by ``get_into``); returns how many."""
    if isinstance(pool, SlotPool):
        return pool.read_with(hashes, lambda first, count, rows: read(first, count, blocks_tensor(rows, spec, dtype)))
    buf = torch.empty(len(hashes), *spec.block_shape, dtype=dtype)
    got = pool.get_into(list(hashes), buf)
    if got:
        read(0, got, buf[:got])
    return got
