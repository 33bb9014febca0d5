"""What a connector needs from the pool, and an in-process pool with the same contract.

Connectors and the reference engine talk to the pool only through ``BlockPool`` (the
methods of ``kvpool.client.PoolClient`` they use), so their logic is tested without a
daemon and runs against the real client unchanged.

``InProcessPool`` is a test double only: it keeps blocks in a dict inside the calling
process so connector and engine logic can be unit tested without a daemon. Nothing outside
the tests uses it: the engine worker (``kvpool.engine.worker``), ``tools/bench_reuse.py``
and the integration tests run against the real daemon through ``PoolClient``. It keeps the
pool's rules with the project's own pieces (``block_hashes`` for the hashes, ``checksum64``
on put, verified after the copy on read; a bad block truncates the read), so a test that
passes here exercises the same contract the daemon enforces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvpool.client.blocks import BlockFill, BlockUse
from kvpool.core.checksum import checksum64
from kvpool.core.errors import InvalidArgument
from kvpool.core.hashing import block_hashes
from kvpool.core.spec import KVSpec, Namespace


@runtime_checkable
class BlockPool(Protocol):
    """The slice of ``PoolClient`` that connectors use."""

    def hashes(self, token_ids: Any) -> list[bytes]:
        """The block-hash chain of a prompt in the pool's namespace (full blocks only)."""
        ...

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` the pool holds."""
        ...

    def put(self, hashes: Sequence[bytes], blocks: Any) -> Any:
        """Store ``blocks`` ([n, *spec.block_shape]) under ``hashes``; present ones are skipped."""
        ...

    def get_into(self, hashes: Sequence[bytes], out: Any) -> int:
        """Copy the leading held blocks into ``out``, checksum-verified; returns how many."""
        ...


class Staged(Protocol):
    """A put written into the pool but not visible yet (``kvpool.client.pool_client.StagedPut``)."""

    @property
    def written_blocks(self) -> int:
        """Blocks written (the others were present or in flight)."""
        ...

    def commit(self) -> Any:
        """Make the written blocks visible."""
        ...

    def abort(self) -> None:
        """Drop the written blocks."""
        ...


@runtime_checkable
class SlotPool(BlockPool, Protocol):
    """A pool whose slots a connector writes and reads in place (``PoolClient.stage_put`` /
    ``read_with``): the engine's pages are gathered straight into the put's arena slots and
    scattered straight from the leased bytes, with no staging buffer. Connectors fall back to
    ``put`` / ``get_into`` with a buffer for a pool without these (``CompressedPool``)."""

    def stage_put(self, hashes: Sequence[bytes], fill: BlockFill) -> Staged | None:
        """Write blocks in place through ``fill``; None when nothing could be started (pool down)."""
        ...

    def read_with(self, hashes: Sequence[bytes], use: BlockUse) -> int:
        """Hand the leading verified blocks to ``use`` in place; returns how many."""
        ...


def pool_spec(pool: object) -> KVSpec | None:
    """The pool's KVSpec when the pool object exposes one (``PoolClient.spec``)."""
    spec = getattr(pool, "spec", None)
    return spec if isinstance(spec, KVSpec) else None


def _rows(blocks: Any, spec: KVSpec, what: str) -> np.ndarray:
    """[n, block_bytes] uint8 view of a numpy array or CPU torch tensor of blocks."""
    shape = tuple(blocks.shape)
    if len(shape) != 6 or shape[1:] != spec.block_shape:
        raise InvalidArgument(f"{what} has shape {shape}, expected [n, *{spec.block_shape}]")
    if hasattr(blocks, "untyped_storage"):  # torch tensor
        import torch

        if not blocks.is_contiguous() or blocks.device.type != "cpu":
            raise InvalidArgument(f"{what} must be a contiguous CPU tensor")
        arr = blocks.detach().reshape(-1).view(torch.uint8).numpy()
    else:
        arr = np.ascontiguousarray(blocks).reshape(-1).view(np.uint8)
    return arr.reshape(shape[0], spec.block_bytes)


class InProcessPool:
    """Test double of the pool in this process: ``capacity_blocks`` bounded, FIFO eviction."""

    def __init__(self, spec: KVSpec, salt: bytes = b"", capacity_blocks: int = 65_536) -> None:
        """A dictionary of at most ``capacity_blocks`` blocks (oldest dropped first), for tests and examples."""
        if capacity_blocks <= 0:
            raise InvalidArgument("capacity_blocks must be positive")
        self.spec = spec
        self.namespace = Namespace(spec, salt)
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[bytes, tuple[bytes, int]] = {}

    def hashes(self, token_ids: Any) -> list[bytes]:
        """The hash chain of ``token_ids`` in this pool's namespace."""
        return block_hashes(self.namespace, token_ids)

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` are held."""
        for i, h in enumerate(hashes):
            if h not in self._blocks:
                return i
        return len(hashes)

    def put(self, hashes: Sequence[bytes], blocks: Any) -> int:
        """Store blocks under ``hashes``; returns how many were new."""
        rows = _rows(blocks, self.spec, "blocks")
        if rows.shape[0] != len(hashes):
            raise InvalidArgument(f"{len(hashes)} hashes for {rows.shape[0]} blocks")
        stored = 0
        for h, row in zip(hashes, rows):
            if h in self._blocks:
                continue
            while len(self._blocks) >= self.capacity_blocks:
                del self._blocks[next(iter(self._blocks))]
            data = row.tobytes()
            self._blocks[h] = (data, checksum64(data))
            stored += 1
        return stored

    def get_into(self, hashes: Sequence[bytes], out: Any) -> int:
        """Copy the leading held blocks into ``out``, each checksum-verified; returns how many."""
        rows = _rows(out, self.spec, "out")
        if rows.shape[0] < len(hashes):
            raise InvalidArgument(f"out holds {rows.shape[0]} blocks, {len(hashes)} asked for")
        for i, h in enumerate(hashes):
            entry = self._blocks.get(h)
            if entry is None:
                return i
            rows[i] = np.frombuffer(entry[0], dtype=np.uint8)
            if checksum64(rows[i]) != entry[1]:
                return i
        return len(hashes)

    def stage_put(self, hashes: Sequence[bytes], fill: BlockFill) -> _StagedInProcess:
        """``fill`` writes the new blocks into private rows, stored on ``commit``."""
        todo = [i for i, h in enumerate(hashes) if h not in self._blocks]
        rows = np.empty((len(hashes), self.spec.block_bytes), dtype=np.uint8)
        for i in todo:  # one block per call: the pool's slots need not be adjacent
            fill(i, 1, rows[i : i + 1])
        return _StagedInProcess(self, [(hashes[i], rows[i].tobytes()) for i in todo])

    def read_with(self, hashes: Sequence[bytes], use: BlockUse) -> int:
        """Hand the leading held, verified blocks to ``use`` one at a time; returns how many."""
        for i, h in enumerate(hashes):
            entry = self._blocks.get(h)
            if entry is None or checksum64(entry[0]) != entry[1]:
                return i
            row = np.frombuffer(entry[0], dtype=np.uint8).reshape(1, -1)  # read-only, like the arena
            use(i, 1, row)
        return len(hashes)

    def corrupt(self, h: bytes) -> None:
        """Flip one byte of a stored block without fixing its checksum (fault injection for tests)."""
        data, check = self._blocks[h]
        self._blocks[h] = (bytes([data[0] ^ 0xFF]) + data[1:], check)


class _StagedInProcess:
    def __init__(self, pool: InProcessPool, blocks: list[tuple[bytes, bytes]]) -> None:
        self._pool, self._blocks = pool, blocks

    @property
    def written_blocks(self) -> int:
        return len(self._blocks)

    def commit(self) -> int:
        stored = 0
        for h, data in self._blocks:
            if h in self._pool._blocks:
                continue
            while len(self._pool._blocks) >= self._pool.capacity_blocks:
                del self._pool._blocks[next(iter(self._pool._blocks))]
            self._pool._blocks[h] = (data, checksum64(data))
            stored += 1
        self._blocks = []
        return stored

    def abort(self) -> None:
        self._blocks = []
