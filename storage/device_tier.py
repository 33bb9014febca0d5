"""The device (HBM) tier of one node: one arena of torch tensor memory on the CUDA device,
with the same slab allocator, eviction policies and checksums as the host tier.

Why a separate arena: HBM is the scarcest tier and the only one a GPU kernel or a GPU-direct
transport can read without a copy, so it holds the hottest blocks (promoted from the host
tier on repeated hits); an eviction demotes a block the tiers below no longer hold, through
the ``on_evict`` hook, so nothing hot is lost by leaving HBM.

Without CUDA the tier does not exist. Tests exercise the same logic on ``device="cpu"``
through the explicit ``allow_cpu`` switch (never set by the daemon), so the CPU suite covers
everything but the copies across PCIe; the CUDA path is tested by tests marked ``gpu``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.core.checksum import checksum64
from kvpool.core.errors import InvalidArgument, StorageFault
from kvpool.core.invariants import checked_after, require
from kvpool.storage.allocator import SlabAllocator, slot_size_for
from kvpool.storage.eviction import EvictionPolicy, make_policy
from kvpool.storage.watermarks import WatermarkDrain

#: called with (key, namespace, checksum, bytes copied to host) for each evicted block
DeviceDemoteHook = Callable[[bytes, bytes, int, np.ndarray], None]


class _DeviceEntry:
    __slots__ = ("checksum", "key", "namespace", "offset", "size")

    def __init__(self, key: bytes, offset: int, size: int, checksum: int, namespace: bytes) -> None:
        self.key = key
        self.offset = offset
        self.size = size
        self.checksum = checksum
        self.namespace = namespace


@dataclass
class DeviceStats:
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    puts: int = 0
    evictions: int = 0
    demotions: int = 0
    removed: int = 0
    checksum_failures: int = 0
    rejected: int = 0  # puts that found no room (everything else too hot to evict)


class DeviceTier:
    """Blocks in device memory. Thread-safe (one lock); copies run under it."""

    def __init__(
        self,
        capacity_bytes: int,
        slab_bytes: int,
        *,
        device: str = "cuda",
        policy: str = "lru",
        allow_cpu: bool = False,
        on_evict: DeviceDemoteHook | None = None,
        high_watermark: float = 1.0,
        low_watermark: float = 1.0,
    ) -> None:
        import torch  # heavy import only where a device tier is configured

        if device == "cpu" and not allow_cpu:
            raise InvalidArgument(
                "a device tier on 'cpu' exists only for tests",
                hint="use device='cuda' (or set device capacity 0 on machines without a GPU)",
            )
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise StorageFault(
                "a device tier was configured but CUDA is not available",
                hint="set --device-capacity-bytes 0 on a machine without a GPU",
            )
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise InvalidArgument(
                f"device watermarks must satisfy 0 < low ({low_watermark}) <= high ({high_watermark}) <= 1"
            )
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self._torch = torch
        self.device = torch.device(device)
        self._alloc = SlabAllocator(capacity_bytes, slab_bytes)
        self.capacity_bytes = self._alloc.capacity_bytes
        self._drain = WatermarkDrain(high_watermark, low_watermark)
        self.arena = torch.empty(self.capacity_bytes, dtype=torch.uint8, device=self.device)
        self._policy_name = policy
        self._policy: EvictionPolicy = make_policy(policy)
        self._on_evict = on_evict
        self._index: dict[bytes, _DeviceEntry] = {}
        self._lock = threading.RLock()
        self._pinned: list[np.ndarray] = []
        self.stats = DeviceStats()

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def meta(self, key: bytes) -> tuple[bytes, int, int] | None:
        """(namespace, size, checksum) of a held block, None if absent: what a caller needs to
        describe the block (a detached ``Entry``, a namespace check) without copying it out."""
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else (entry.namespace, entry.size, entry.checksum)

    def keys(self) -> list[bytes]:
        """Every held key (snapshots of the node's contents)."""
        with self._lock:
            return list(self._index)

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def used_bytes(self) -> int:
        return self._alloc.used_bytes

    @checked_after
    def put(self, key: bytes, namespace: bytes, data: np.ndarray, checksum: int) -> bool:
        """Copy a host block into the device arena, evicting by policy. False if no room."""
        with self._lock:
            if key in self._index:
                self._policy.on_access(key)
                return True
            size = int(data.size)
            self._alloc.check_block_bytes(size)
            self._evict_to_low_watermark(slot_size_for(size))
            offset = self._alloc.alloc(size)
            while offset is None:
                if not self._evict_one():
                    self.stats.rejected += 1
                    return False
                offset = self._alloc.alloc(size)
            src = self._torch.from_numpy(np.ascontiguousarray(data).reshape(-1))
            self.arena[offset : offset + size].copy_(src, non_blocking=False)
            self._index[key] = _DeviceEntry(key, offset, size, checksum, namespace)
            self._policy.on_insert(key)
            self.stats.puts += 1
            self.stats.bytes_in += size
            return True

    @checked_after
    def get(self, key: bytes) -> tuple[bytes, int, np.ndarray] | None:
        """(namespace, checksum, host copy of the bytes), verified against the checksum the
        block arrived with; None on a miss or a failed check (the block is then dropped and
        counted)."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            data = self._copy_out(entry)
            if checksum64(data) != entry.checksum:
                self.stats.checksum_failures += 1
                self.stats.misses += 1
                self._policy.on_remove(key)
                self._drop(entry)
                return None
            self._policy.on_access(key)
            self.stats.hits += 1
            self.stats.bytes_out += entry.size
            return entry.namespace, entry.checksum, data

    def tensor(self, key: bytes) -> Any:
        """A device view of the block (for in-process GPU consumers); valid until evicted."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            return self.arena[entry.offset : entry.offset + entry.size]

    @checked_after
    def remove(self, key: bytes) -> bool:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return False
            self._policy.on_remove(key)
            self._drop(entry)
            self.stats.removed += 1
            return True

    def pin_host(self, buffer: np.ndarray) -> bool:
        """Page-lock the host arena with ``cudaHostRegister`` so host <-> device copies run at
        full PCIe speed (DMA straight from the arena). False where CUDA is absent or refuses."""
        if self.device.type != "cuda" or buffer.nbytes == 0:
            return False
        cudart = self._torch.cuda.cudart()
        err = cudart.cudaHostRegister(buffer.ctypes.data, buffer.nbytes, 0)
        ok = int(getattr(err, "value", err)) == 0
        if ok:
            self._pinned.append(buffer)
        return ok

    def close(self) -> None:
        """Unregister pinned host memory and drop the arena."""
        if self._pinned:
            cudart = self._torch.cuda.cudart()
            for buffer in self._pinned:
                cudart.cudaHostUnregister(buffer.ctypes.data)
            self._pinned.clear()
        with self._lock:
            self._index.clear()
            self.arena = self._torch.empty(0, dtype=self._torch.uint8, device=self.device)

    def summary(self) -> dict[str, object]:
        with self._lock:
            s = self.stats
            return {
                "device": str(self.device),
                "policy": self._policy_name,
                "capacity_bytes": self.capacity_bytes,
                "high_watermark": self.high_watermark,
                "low_watermark": self.low_watermark,
                "used_bytes": self._alloc.used_bytes,
                "blocks": len(self._index),
                "hits": s.hits,
                "misses": s.misses,
                "bytes_in": s.bytes_in,
                "bytes_out": s.bytes_out,
                "puts": s.puts,
                "evictions": s.evictions,
                "demotions": s.demotions,
                "removed": s.removed,
                "checksum_failures": s.checksum_failures,
                "rejected": s.rejected,
                "host_pinned": bool(self._pinned),
            }

    def check_invariants(self) -> None:
        """Every held block owns one slot of its size class and the allocator's bytes are
        exactly theirs (debug mode, ``kvpool.core.invariants``)."""
        name = "DeviceTier"
        with self._lock:
            self._alloc.check_invariants()
            offsets: set[int] = set()
            slot_bytes = 0
            for key, entry in self._index.items():
                require(name, "an entry is indexed under its key", entry.key == key, key.hex)
                require(name, "no two blocks share a slot", entry.offset not in offsets, key.hex)
                require(
                    name,
                    "a block's slot is of its size class",
                    self._alloc.slot_bytes_at(entry.offset) == slot_size_for(entry.size),
                    key.hex,
                )
                offsets.add(entry.offset)
                slot_bytes += slot_size_for(entry.size)
            require(name, "allocated bytes are the blocks' slots", slot_bytes == self._alloc.used_bytes)

    # -- internals -----------------------------------------------------------------------
    def _copy_out(self, entry: _DeviceEntry) -> np.ndarray:
        """A private host copy of the block: on CUDA ``.cpu()`` already is that copy; on the
        test-only CPU device it is a view of the arena, so copy it once."""
        view = self.arena[entry.offset : entry.offset + entry.size]
        if view.device.type == "cpu":
            return view.numpy().copy()
        return view.cpu().numpy()

    def _drop(self, entry: _DeviceEntry) -> None:
        del self._index[entry.key]
        self._alloc.free(entry.offset)

    def _evict_to_low_watermark(self, need_bytes: int) -> None:
        """Once a copy would take the arena above the high watermark, each copy evicts
        (demotes) by policy its own room and as much again until usage is at the low watermark
        (storage/watermarks.py). 1.0 / 1.0 evicts only when a copy finds no room."""
        floor = self._drain.floor(self._alloc.used_bytes, need_bytes, self.capacity_bytes)
        self._drain.evict(floor, lambda: self._alloc.used_bytes, self._evict_one)

    def _evict_one(self) -> bool:
        key = self._policy.pop_victim(lambda k: k in self._index)
        if key is None:
            return False
        entry = self._index[key]
        if self._on_evict is not None:
            self._on_evict(key, entry.namespace, entry.checksum, self._copy_out(entry))
            self.stats.demotions += 1
        self._drop(entry)
        self.stats.evictions += 1
        return True
