"""Writing the host tier's blocks to the disk tier before the daemon exits (SIGTERM).

Why: the host arena is process memory; a clean stop would otherwise lose every block that
was never evicted (the only ones the write-behind path puts on disk). With a disk tier, the
daemon's stop drains the write-behind queue and then writes each host block the disk does
not hold, newest first (the ones a restarted engine is likeliest to ask for), in durable
batches (data ``fdatasync``'d before its index record commits), until done or until
``shutdown_flush_ms`` has passed. The outcome is logged: how many were written, how many
were not, and why (deadline, disk full, no slot, I/O error, checksum).

A full disk tier makes room by its eviction policy, as for any write: a block the engine
used recently (host) is worth more than the disk's least recently used one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvpool.core.checksum import checksum64
from kvpool.storage.disk_tier import DiskTier
from kvpool.storage.host_store import HostStore

log = logging.getLogger("kvpool.storage.shutdown_flush")

#: one durable batch (one fdatasync + one index commit) holds at most this many blocks...
FLUSH_BATCH_BLOCKS = 1024
#: ...and at most this many bytes (each block is copied into an aligned buffer first)
FLUSH_BATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class ShutdownFlushReport:
    """What the shutdown flush did. ``not_flushed`` maps a reason to a block count."""

    host_blocks: int  # blocks in the host tier when the flush began
    already_on_disk: int  # of those, the disk held (or had queued) a copy
    flushed: int  # written and committed by this flush
    not_flushed: dict[str, int] = field(default_factory=dict)
    queue_drained: bool = True  # the write-behind queue emptied within the deadline
    elapsed_ms: float = 0.0

    @property
    def lost(self) -> int:
        return sum(self.not_flushed.values())


def flush_host_to_disk(
    host: HostStore,
    buffer: np.ndarray,
    disk: DiskTier,
    timeout_ms: int,
    now_s: Callable[[], float] = time.monotonic,
    batch_blocks: int = FLUSH_BATCH_BLOCKS,
    batch_bytes: int = FLUSH_BATCH_BYTES,
) -> ShutdownFlushReport:
    """Drain the write-behind queue, then write every host-only block to ``disk`` within
    ``timeout_ms`` (see the module docstring). Call when no client can write any more."""
    started = now_s()
    deadline = started + timeout_ms / 1000.0
    drained = disk.flush(max(0.0, deadline - now_s()))
    keys = list(reversed(host.snapshot_keys()))  # newest first
    on_disk = disk.present(keys) if keys else []
    todo = [k for k, present in zip(keys, on_disk) if not present]
    reasons: dict[str, int] = {}
    flushed = 0
    stats = disk.stats
    i = 0
    while i < len(todo):
        if now_s() >= deadline:
            reasons["deadline"] = len(todo) - i
            break
        batch: list[tuple[bytes, bytes, np.ndarray, int]] = []
        nbytes = 0
        while i < len(todo) and len(batch) < batch_blocks and (not batch or nbytes < batch_bytes):
            key = todo[i]
            i += 1
            entry = host.entry(key)
            if entry is None:
                continue  # removed meanwhile: nothing to keep
            data = buffer[entry.offset : entry.offset + entry.size]
            if checksum64(data) != entry.checksum:  # never persist bytes that do not verify
                reasons["checksum"] = reasons.get("checksum", 0) + 1
                continue
            batch.append((key, entry.namespace, data, entry.checksum))
            nbytes += entry.size
        if not batch:
            continue
        unplaced, full = stats.unplaced_drops, stats.disk_full
        committed = disk.write_now(batch)
        flushed += committed
        failed = len(batch) - committed
        no_slot = min(failed, stats.unplaced_drops - unplaced)
        if no_slot:
            reasons["no_slot"] = reasons.get("no_slot", 0) + no_slot
        if failed > no_slot:
            reason = "disk_full" if stats.disk_full > full else "io_error"
            reasons[reason] = reasons.get(reason, 0) + failed - no_slot
    report = ShutdownFlushReport(
        host_blocks=len(keys),
        already_on_disk=len(keys) - len(todo),
        flushed=flushed,
        not_flushed={k: v for k, v in reasons.items() if v},
        queue_drained=drained,
        elapsed_ms=(now_s() - started) * 1000.0,
    )
    level = logging.INFO if report.lost == 0 and drained else logging.WARNING
    log.log(
        level,
        "shutdown flush to %s: %d host blocks, %d already on disk, %d written, %d not written %s in %.0f ms "
        "(limit %d ms, --shutdown-flush-ms)%s",
        disk.directory,
        report.host_blocks,
        report.already_on_disk,
        report.flushed,
        report.lost,
        report.not_flushed or "",
        report.elapsed_ms,
        timeout_ms,
        "" if drained else "; the write-behind queue did not drain in time",
    )
    return report
