"""One record per block of a ``TieredStore``, and the transitions between its states.

Why one record: a block's moves between tiers (a promotion into host, a device demotion
back to host) read it outside every lock and commit it later, while a ``remove()`` may run
at any point in between. What each of them must know about the others (is a remove in
flight, did one finish since I started, which copy does the table alone still hold, where
did a host eviction send the block) is kept in one ``BlockRecord`` per block, changed only
by the ``BlockTable`` methods below, each one transition under the table's one lock.

A record holds (all zero / empty when nothing is going on, and then it is deleted, so
the table holds only blocks that are hit, moving or being removed):

- ``generation``: removals completed; a move records it when prepared, and a generation
  that changed, or a remove in progress (``removing``), *fences* the move: it must not
  commit, or must remove again if it already did;
- ``removing``: removes in progress; ``promoting`` / ``demoting``: moves in flight;
- ``queued``: the bytes of a device eviction waiting to go back to host (the only copy
  left on the node), in the order they were queued;
- ``moved_to``: the tier a host eviction just sent the block to ("disk", "device"), which
  turns the host's REMOVED into STORED naming that tier; ``evict_failed``: the host copy
  failed its checksum on the way down (not demoted), so the host's REMOVED says why;
- ``hits``: host hits (second-hit admission, device promotion);
- ``taken`` / ``restored``: what a remove in progress learned while it ran: the table's
  only copy was dropped for it (so it counts the block and reports REMOVED), or a put
  stored the block in host again (its STORED is then the last word: no REMOVED).

Transitions (docs/tiers.md, "One record per block"):

    remove:   prepare_remove -> (tiers remove their copies) -> complete_remove
    promote:  prepare_moves("promote") -> read, fenced?, put, fenced? -> complete_moves
    demote:   queue_demotion (device eviction) -> take_demotions -> fenced? -> complete_moves
    evict:    host_evicted -> demoted -> take_moved (the host's REMOVED)
    hits:     count_hits, and host_evicted / prepare_remove forget them

The second-hit admission memory (``ghost``) is here too, under the same lock: blocks that
left the node once, bounded by ``ghost_keys``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.core.invariants import require

#: a move's fence: the generation of each of its blocks when it was prepared
Fence = dict[bytes, int]

MOVE_KINDS = ("promote", "demote")
MOVED_TIERS = ("disk", "device")


@dataclass(frozen=True)
class DeviceDemotion:
    """A block evicted from HBM: its bytes (a private host copy) waiting for host."""

    namespace: bytes
    checksum: int
    data: np.ndarray


class BlockRecord:
    """The tiered store's state of one block (see the module docstring). Slotted."""

    __slots__ = (
        "demoting",
        "evict_failed",
        "generation",
        "hits",
        "moved_to",
        "promoting",
        "queued",
        "removing",
        "restored",
        "taken",
    )

    def __init__(self) -> None:
        self.generation = 0
        self.removing = 0
        self.promoting = 0
        self.demoting = 0
        self.queued: DeviceDemotion | None = None
        self.moved_to = ""
        self.evict_failed = False
        self.hits = 0
        self.taken = False
        self.restored = False

    def idle(self) -> bool:
        """Nothing to remember: the record can go (its generation matters to no move)."""
        return not (
            self.removing
            or self.promoting
            or self.demoting
            or self.hits
            or self.moved_to
            or self.evict_failed
            or self.taken
            or self.restored
            or self.queued is not None
        )


class BlockTable:
    """Every ``BlockRecord`` of one store, under ``lock``. Each public method is one
    transition and takes the lock itself, except where it says it is called with it held."""

    def __init__(self, ghost_keys: int) -> None:
        self.lock = threading.Lock()
        self._records: dict[bytes, BlockRecord] = {}
        self._queue: dict[bytes, None] = {}  # keys with ``queued`` bytes, oldest first
        self._removing = 0  # sum of ``removing`` (fast path: no remove in flight)
        self.ghost: OrderedDict[bytes, None] = OrderedDict()
        self.ghost_keys = ghost_keys

    def __len__(self) -> int:
        with self.lock:
            return len(self._records)

    def get(self, key: bytes) -> BlockRecord | None:
        """The record of ``key`` (tests and ``check_invariants``; do not change it)."""
        with self.lock:
            return self._records.get(key)

    def queued_keys(self) -> list[bytes]:
        """Blocks evicted from HBM and waiting for host, oldest first."""
        with self.lock:
            return list(self._queue)

    def busy_keys(self) -> list[bytes]:
        """Blocks with a remove or a move in flight (none once every call has returned)."""
        with self.lock:
            return [k for k, r in self._records.items() if r.removing or r.promoting or r.demoting]

    def _record(self, key: bytes) -> BlockRecord:
        rec = self._records.get(key)
        if rec is None:
            rec = self._records[key] = BlockRecord()
        return rec

    def _settle(self, key: bytes, rec: BlockRecord) -> None:
        if rec.idle():
            del self._records[key]

    # -- remove ----------------------------------------------------------------------------
    def prepare_remove(self, keys: Sequence[bytes]) -> None:
        """A remove starts: fence every move of these blocks, forget their hits, and take
        over the device evictions still queued for host (only the table holds them)."""
        with self.lock:
            for key in keys:
                rec = self._record(key)
                rec.removing += 1
                self._removing += 1
                rec.hits = 0
                if rec.queued is not None or rec.demoting:
                    self._take(key, rec)

    def _take(self, key: bytes, rec: BlockRecord) -> None:
        """Called with the lock held: a remove in progress owns the table's copy now."""
        if rec.queued is not None:
            rec.queued = None
            del self._queue[key]
        rec.taken = True

    def complete_remove(
        self, keys: Sequence[bytes], below: set[bytes], in_host: set[bytes], emit_removed: Callable[[list[bytes]], None]
    ) -> int:
        """The tiers have dropped their copies: ``below`` are the keys a lower tier held,
        ``in_host`` those the host held (and already reported). End the fence (generation
        + 1) and report REMOVED, once, for the blocks only a lower tier or the table held,
        except those a put stored in host again meanwhile (its STORED came after the
        removal). Returns how many of those blocks there were (the remove counts them)."""
        with self.lock:
            gone: list[bytes] = []
            report: list[bytes] = []
            for key in keys:
                rec = self._records[key]
                rec.removing -= 1
                self._removing -= 1
                rec.generation += 1
                if rec.queued is not None:  # evicted from HBM during the remove
                    self._take(key, rec)
                held_below = key in below or rec.taken
                restored = rec.restored
                rec.taken = False
                if not rec.removing:
                    rec.restored = False
                self._settle(key, rec)
                if held_below and key not in in_host:
                    gone.append(key)
                    if not restored:
                        report.append(key)
            if report:
                emit_removed(report)  # under the lock: ordered with a put's STORED
            return len(gone)

    # -- moves: promotion and device demotion -------------------------------------------------
    def prepare_moves(self, keys: Iterable[bytes], kind: str) -> Fence:
        """A move of ``keys`` starts (``kind`` "promote" or "demote"): their records stay
        while it runs; returns the fence it checks before and after its commit."""
        with self.lock:
            fence: Fence = {}
            for key in keys:
                rec = self._record(key)
                if kind == "promote":
                    rec.promoting += 1
                else:
                    rec.demoting += 1
                fence[key] = rec.generation
            return fence

    def fenced(self, fence: Fence, keys: Iterable[bytes]) -> list[bytes]:
        """The keys a remove works on now, or finished since ``fence`` was taken."""
        with self.lock:
            out = []
            for key in keys:
                rec = self._records[key]
                if rec.removing or rec.generation != fence[key]:
                    out.append(key)
            return out

    def complete_moves(self, fence: Fence, kind: str) -> None:
        with self.lock:
            for key in fence:
                rec = self._records[key]
                if kind == "promote":
                    rec.promoting -= 1
                else:
                    rec.demoting -= 1
                self._settle(key, rec)

    def queue_demotion(self, key: bytes, demotion: DeviceDemotion) -> None:
        """The device tier evicted a block no faster tier may hold: keep its bytes for host
        (a newer eviction of the same block replaces an older one). Under a remove in
        progress the remove takes it instead."""
        with self.lock:
            rec = self._record(key)
            if rec.removing:
                rec.taken = True
                return
            rec.queued = demotion
            self._queue.pop(key, None)
            self._queue[key] = None

    def take_demotions(self) -> tuple[list[tuple[bytes, DeviceDemotion]], Fence]:
        """Every queued device eviction, oldest first, now being demoted (one fence)."""
        with self.lock:
            if not self._queue:
                return [], {}
            taken: list[tuple[bytes, DeviceDemotion]] = []
            fence: Fence = {}
            for key in self._queue:
                rec = self._records[key]
                assert rec.queued is not None
                taken.append((key, rec.queued))
                rec.queued = None
                rec.demoting += 1
                fence[key] = rec.generation
            self._queue.clear()
            return taken, fence

    def emit_unless_fenced(self, fence: Fence, key: bytes, emit: Callable[[], None]) -> bool:
        """Send a move's event only if no remove fenced it, atomically with that check
        (a remove that starts later reports REMOVED after it). False when fenced."""
        with self.lock:
            rec = self._records[key]
            if rec.removing or rec.generation != fence[key]:
                return False
            emit()
            return True

    # -- host evictions and events ------------------------------------------------------------
    def host_evicted(self, key: bytes, in_device: bool, on_disk: bool, has_disk: bool, second_hit: bool) -> str:
        """Host evicts ``key`` (called under the host lock, before its REMOVED); the caller
        asked the other tiers first, outside this lock. Forgets its hits, notes the tier
        that keeps it, and returns what to do: "keep" (no disk, or on disk already),
        "skip" (a one-hit block second-hit admission only remembers) or "demote"."""
        with self.lock:
            rec = self._records.get(key)
            hits = 0
            if rec is not None:
                hits, rec.hits = rec.hits, 0
            kept_in = "device" if in_device else "disk" if has_disk and on_disk else ""
            if kept_in:
                rec = rec if rec is not None else self._record(key)
                if not rec.moved_to:
                    rec.moved_to = kept_in
            if rec is not None:
                self._settle(key, rec)
            if not has_disk or on_disk:
                return "keep"
            return "demote" if self._admit(key, hits, second_hit) else "skip"

    def _admit(self, key: bytes, hits: int, second_hit: bool) -> bool:
        if second_hit and hits == 0 and key not in self.ghost:
            self.ghost[key] = None
            while len(self.ghost) > self.ghost_keys:
                self.ghost.popitem(last=False)
            return False
        self.ghost.pop(key, None)
        return True

    def demoted(self, key: bytes) -> None:
        """The evicted block is in the disk write queue: it stays on the node, on disk."""
        with self.lock:
            rec = self._record(key)
            if not rec.moved_to:
                rec.moved_to = "disk"

    def evicted_bad(self, key: bytes) -> None:
        """The evicted host copy of ``key`` failed its checksum: not demoted; the host's
        REMOVED that follows (under the host lock) names the cause."""
        with self.lock:
            self._record(key).evict_failed = True

    def host_event(
        self,
        removed: bool,
        keys: list[bytes],
        emit: Callable[[list[bytes], str, str], None],
        emit_moved: Callable[[list[bytes], str], None],
    ) -> None:
        """The host reports STORED or REMOVED for ``keys``: a REMOVED of a block a host
        eviction moved to another tier becomes STORED naming it, one whose evicted copy
        failed its checksum goes out with cause "checksum_failure"; a STORED during a remove
        marks the block restored. Events go out under the lock (ordered with removals)."""
        with self.lock:
            moved: dict[str, list[bytes]] = {}
            failed: list[bytes] = []
            if removed:
                kept = []
                for key in keys:
                    rec = self._records.get(key)
                    if rec is None or not (rec.moved_to or rec.evict_failed):
                        kept.append(key)
                        continue
                    if rec.evict_failed:
                        failed.append(key)
                    else:
                        moved.setdefault(rec.moved_to, []).append(key)
                    rec.moved_to, rec.evict_failed = "", False
                    self._settle(key, rec)
                keys = kept
                if failed:
                    emit(failed, "host", "checksum_failure")
            elif self._removing:
                for key in keys:
                    rec = self._records.get(key)
                    if rec is not None and rec.removing:
                        rec.restored = True
            if keys:
                emit(keys, "host", "")
            for tier, moved_keys in moved.items():
                emit_moved(moved_keys, tier)

    def count_hits(self, keys: Iterable[bytes], hot_after: int) -> list[bytes]:
        """One host hit for each of ``keys``; returns those that just reached ``hot_after``."""
        with self.lock:
            hot = []
            records = self._records
            for key in keys:  # the lease path: no call per key
                rec = records.get(key)
                if rec is None:
                    rec = records[key] = BlockRecord()
                rec.hits += 1
                if rec.hits == hot_after:
                    hot.append(key)
            return hot

    # -- invariants ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The table's rules (debug mode, ``kvpool.core.invariants``)."""
        name = "BlockTable"
        with self.lock:
            removing = 0
            for key, rec in self._records.items():
                require(name, "a record is not idle", not rec.idle(), key.hex)
                require(
                    name,
                    "counts are not negative",
                    min(rec.removing, rec.promoting, rec.demoting, rec.hits, rec.generation) >= 0,
                    key.hex,
                )
                require(name, "moved_to names a lower tier", rec.moved_to in ("", *MOVED_TIERS), rec.moved_to)
                require(
                    name,
                    "queued bytes are in the queue",
                    (rec.queued is not None) == (key in self._queue),
                    key.hex,
                )
                require(
                    name,
                    "taken and restored only during a remove",
                    rec.removing > 0 or not (rec.taken or rec.restored),
                    key.hex,
                )
                removing += rec.removing
            require(name, "the queue names records", all(k in self._records for k in self._queue))
            require(name, "removes in flight add up", removing == self._removing, f"{removing} != {self._removing}")
            require(name, "the ghost set is bounded", len(self.ghost) <= self.ghost_keys)
