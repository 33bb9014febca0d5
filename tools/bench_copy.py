"""Baselines for tools/bench_pool.py: plain copies of the same bytes on the same kind of
memory, measured in the same run as kvpool (issue 13, item 1).

- ``SharedMapping``: a file in /dev/shm mapped ``MAP_SHARED``, i.e. shared memory on 4 KiB
  pages (this host's ``shmem_enabled`` is ``never``: no transparent huge pages for it), as a
  4 KiB-page kvpool arena is. Copies out of it (reads) and into it (writes) are timed at
  several copy sizes, because the C library's memcpy takes different paths by size
  (``rep movsb`` from ~2 KiB, non-temporal stores above ``x86_non_temporal_threshold``); the
  baseline is the best size. The sizes include the whole buffer in one call: on the bench
  host glibc 2.36 streams (non-temporal stores) only above 128 MiB, and a 256 MiB copy ran at
  8.7-9.3 GB/s where every piece of 4-128 MiB ran at 5.3-6.0 (so a baseline of pieces only
  flattered kvpool by ~1.5x before 2026-12-02).
- ``private_huge``: anonymous private memory with ``MADV_HUGEPAGE`` (transparent huge pages),
  copied to another such buffer: what a copy costs at this machine's memory speed, the
  physical limit for any same-host path.
- ``copy_workers``: the same plain copy in N processes at once (each its own region), the
  baseline of N kvpool clients reading at once.
"""

from __future__ import annotations

import functools
import mmap
import multiprocessing as mp
import os
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

KiB = 1024
MiB = 1024 * KiB
#: copy sizes the shared-mapping baseline tries (its best is the baseline), besides the whole
#: buffer in one call (``Baselines.pick_pieces``)
PIECES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 64 * MiB)


@dataclass(frozen=True)
class Spread:
    """Median and range of one measurement over its repeats, in GB/s."""

    median_GBps: float
    low_GBps: float
    high_GBps: float

    @classmethod
    def of(cls, nbytes: int, seconds: Sequence[float]) -> Spread:
        rates = [nbytes / s / 1e9 for s in seconds]
        return cls(statistics.median(rates), min(rates), max(rates))

    def text(self) -> str:
        return f"{self.median_GBps:6.2f} [{self.low_GBps:5.2f}-{self.high_GBps:5.2f}]"


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_in_pieces(dst: np.ndarray, src: np.ndarray, piece_bytes: int) -> None:
    for start in range(0, src.shape[0], piece_bytes):
        np.copyto(dst[start : start + piece_bytes], src[start : start + piece_bytes])


class SharedMapping:
    """``nbytes`` of 4 KiB-page shared memory (a /dev/shm file, unlinked at once), filled."""

    def __init__(self, nbytes: int, directory: str = "/dev/shm") -> None:
        path = os.path.join(directory, f"bench-copy-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
        try:
            os.ftruncate(fd, nbytes)
            self._mmap = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.view = np.frombuffer(self._mmap, dtype=np.uint8)
        self.view[:] = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)


def private_huge(nbytes: int) -> np.ndarray:
    """Private anonymous memory asking for transparent huge pages, pre-faulted."""
    mapping = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    arr = np.frombuffer(mapping, dtype=np.uint8)
    arr.fill(7)
    return arr


def anon_huge_bytes() -> int:
    """AnonHugePages of /proc/meminfo: whether the private baseline got huge pages."""
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * KiB
    return 0


@dataclass
class Baselines:
    """The plain copies, kept mapped for the whole run so each repeat re-times the same bytes."""

    nbytes: int
    shared: SharedMapping
    private_src: np.ndarray
    private_dst: np.ndarray
    read_piece_bytes: int = 0
    write_piece_bytes: int = 0

    @classmethod
    def make(cls, nbytes: int) -> Baselines:
        return cls(nbytes, SharedMapping(nbytes), private_huge(nbytes), private_huge(nbytes))

    def pick_pieces(self, repeats: int) -> dict[str, dict[int, float]]:
        """Time every copy size out of and into the shared mapping; keep the best of each."""
        found: dict[str, dict[int, float]] = {"read": {}, "write": {}}
        for piece in sorted({*PIECES, self.nbytes}):
            read = [timed(functools.partial(self.shm_read, piece)) for _ in range(repeats)]
            write = [timed(functools.partial(self.shm_write, piece)) for _ in range(repeats)]
            found["read"][piece] = self.nbytes / statistics.median(read) / 1e9
            found["write"][piece] = self.nbytes / statistics.median(write) / 1e9
        self.read_piece_bytes = max(found["read"], key=lambda p: found["read"][p])
        self.write_piece_bytes = max(found["write"], key=lambda p: found["write"][p])
        return found

    def shm_read(self, piece_bytes: int = 0) -> None:
        copy_in_pieces(self.private_dst, self.shared.view, piece_bytes or self.read_piece_bytes)

    def shm_write(self, piece_bytes: int = 0) -> None:
        copy_in_pieces(self.shared.view, self.private_src, piece_bytes or self.write_piece_bytes)

    def huge_copy(self) -> None:
        np.copyto(self.private_dst, self.private_src)


def _copy_worker(
    shm_name: str, nbytes: int, start: int, piece: int, rounds: int, barrier: Any, out: Any
) -> None:  # pragma: no cover - runs in a child process
    fd = os.open(shm_name, os.O_RDONLY)
    mapping = mmap.mmap(fd, start + nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(fd)
    src = np.frombuffer(mapping, dtype=np.uint8)[start : start + nbytes]
    dst = private_huge(nbytes)
    copy_in_pieces(dst, src, piece)
    for k in range(rounds):
        barrier.wait()
        t0 = time.perf_counter()
        copy_in_pieces(dst, src, piece)
        out.put((k, t0, time.perf_counter()))


class CopyWorkers:
    """N processes that each copy their own ``per_worker_bytes`` out of one shared mapping at
    the same moment (a barrier per round): the baseline of N clients' aggregate get_into."""

    def __init__(self, workers: int, per_worker_bytes: int, piece_bytes: int, rounds: int) -> None:
        self.path = f"/dev/shm/bench-copyworkers-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        total = workers * per_worker_bytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, total)
        os.pwrite(fd, np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8).tobytes(), 0)
        os.close(fd)
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(workers)
        self.out: Any = ctx.Queue()
        self.rounds, self.workers, self.per_worker_bytes = rounds, workers, per_worker_bytes
        self.procs = [
            ctx.Process(
                target=_copy_worker,
                args=(self.path, per_worker_bytes, i * per_worker_bytes, piece_bytes, rounds, self.barrier, self.out),
            )
            for i in range(workers)
        ]

    def run(self) -> list[float]:
        """Aggregate GB/s of each round."""
        for p in self.procs:
            p.start()
        try:
            return aggregate_rounds(self.out, self.workers, self.rounds, self.per_worker_bytes)
        finally:
            for p in self.procs:
                p.join(60)
            os.unlink(self.path)


def aggregate_rounds(out: Any, workers: int, rounds: int, per_worker_bytes: int) -> list[float]:
    """Per round: all workers' bytes / (last end - first start), from the (round, start,
    end) triples the workers send (perf_counter is one clock for every process)."""
    spans: list[list[tuple[float, float]]] = [[] for _ in range(rounds)]
    for _ in range(workers * rounds):
        k, t0, t1 = out.get(timeout=300)
        spans[k].append((t0, t1))
    return [workers * per_worker_bytes / (max(e for _, e in s) - min(b for b, _ in s)) / 1e9 for s in spans]
