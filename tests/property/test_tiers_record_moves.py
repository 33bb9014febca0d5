"""Hypothesis state machine over the block records' transitions with a move in flight
(storage/block_record.py): a promotion (disk or device -> host) or a device demotion
(an HBM eviction going back to host) runs in a second thread and is paused at one of its
steps (after its read, before its put, before its commit) while the main thread puts,
reads, removes, copies blocks to the device tier (evicting others into the demotion queue)
and flushes; then the move finishes.

Whatever the interleaving: a removed block that was not put again never comes back (no
lookup finds it, no tier holds it, its last event is REMOVED), ``remove`` counts exactly
the blocks the node held (a device eviction only the record table holds included), reads
never return wrong bytes, and once every call has returned no record is busy. Debug
invariants are on (tests/conftest.py), so every operation also checks the record table,
the host store, the allocator, the device and the disk state.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig, TierConfig
from kvpool.core.errors import CapacityExhausted
from kvpool.core.events import EventKind
from kvpool.storage.tiered_store import TieredStore

BLOCK = 3000
NS = bytes(range(16))
HOST = StoreConfig(capacity_bytes=1 << 15, slab_bytes=1 << 14, lease_ttl_ms=1000, put_ttl_ms=1000)  # 10 blocks
KEYS = 24
IDS = st.integers(0, KEYS - 1)
POINTS = ["read", "put_start", "put_commit"]  # where a paused move waits
PAUSE_S = 30.0  # a move waits at most this long for the test to let it go (a hung test fails)


def key(i: int) -> bytes:
    return NS + i.to_bytes(16, "little")


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


class MovesInFlight(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvpool-record-moves-")
        self.buffer = np.zeros(HOST.capacity_bytes, np.uint8)
        tiers = TierConfig(
            disk_dir=self.dir,
            disk_capacity_bytes=1 << 16,  # 15 disk slots
            disk_slab_file_bytes=1 << 16,
            disk_io_threads=2,
            write_behind_queue_blocks=8,
            device_capacity_bytes=1 << 14,  # 5 device slots
            device="cpu",
            disk_admission="second-hit",  # blocks read once stay off disk: HBM may hold the only copy
        )
        self.events: list[tuple[EventKind, bytes]] = []
        self.events_lock = threading.Lock()
        self.store = TieredStore(self.buffer, HOST, tiers, FakeClock(), on_event=self._event, device_allow_cpu=True)
        self.gone: set[int] = set()  # removed and not put since
        self.mover: threading.Thread | None = None
        self.pause_at = ""
        self.paused = False
        self.reached = threading.Event()
        self.go = threading.Event()
        self.errors: list[BaseException] = []
        assert self.store.disk is not None
        self._pause_before(self.store.host, "put_start")
        self._pause_before(self.store.host, "put_commit")
        self._pause_after(self.store.disk, "read_many", "read")

    def _event(self, kind: EventKind, keys: list[bytes], namespace: bytes, tier: str = "host", cause: str = "") -> None:
        with self.events_lock:
            self.events.extend((kind, k) for k in keys)

    # -- pausing a move at one of its steps -------------------------------------------------
    def _wait_here(self, point: str) -> None:
        if threading.current_thread() is self.mover and self.pause_at == point and not self.paused:
            self.paused = True
            self.reached.set()
            assert self.go.wait(PAUSE_S), "the test never let the move go"

    def _pause_before(self, obj: Any, name: str) -> None:
        original: Callable[..., Any] = getattr(obj, name)

        def wrapper(*args: Any) -> Any:
            self._wait_here(name)
            return original(*args)

        setattr(obj, name, wrapper)

    def _pause_after(self, obj: Any, name: str, point: str) -> None:
        original: Callable[..., Any] = getattr(obj, name)

        def wrapper(*args: Any) -> Any:
            got = original(*args)
            self._wait_here(point)
            return got

        setattr(obj, name, wrapper)

    def _start(self, point: str, work: Callable[[], None]) -> None:
        def run() -> None:
            try:
                work()
            except BaseException as exc:  # reported by finish_move
                self.errors.append(exc)
            finally:
                self.reached.set()  # finished without reaching the point: nothing to pause

        self.pause_at, self.paused = point, False
        self.reached.clear()
        self.go.clear()
        self.mover = threading.Thread(target=run, name="kvpool-test-mover")
        self.mover.start()
        assert self.reached.wait(PAUSE_S), "the move neither paused nor finished"

    def teardown(self) -> None:
        if self.mover is not None:
            self.go.set()
            self.mover.join(PAUSE_S)
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- the main thread's calls --------------------------------------------------------------
    @rule(first=IDS, n=st.integers(1, 8))
    def put_run(self, first: int, n: int) -> None:
        self.put([(first + j) % KEYS for j in range(n)])

    @rule(ids=st.lists(IDS, min_size=1, max_size=6, unique=True))
    def put(self, ids: list[int]) -> None:
        try:
            grant = self.store.put_start(NS, [key(i) for i in ids], BLOCK)
        except CapacityExhausted:
            return
        sums = []
        for index, offset in grant.slots:
            self.buffer[offset : offset + BLOCK] = data(ids[index])
            sums.append(checksum64(data(ids[index])))
        if grant.put_id:
            assert self.store.put_commit(grant.put_id, sums).checksum_failed == []
            self.gone.difference_update(ids[index] for index, _ in grant.slots)

    def _read(self, ids: list[int]) -> None:
        try:
            grant = self.store.lease([key(i) for i in ids])
        except CapacityExhausted:
            return
        for i, loc in zip(ids, grant.locations):
            assert loc.size == BLOCK
            assert checksum64(self.buffer[loc.offset : loc.offset + BLOCK]) == checksum64(data(i)), f"block {i}"
        if grant.lease_id:
            self.store.release(grant.lease_id)

    @rule(ids=st.lists(IDS, min_size=1, max_size=3, unique=True))
    def get(self, ids: list[int]) -> None:
        self._read(ids)

    @rule(i=IDS)
    def copy_to_device(self, i: int) -> None:
        """As two host hits do: copy a host block (the first from ``i`` on) to HBM,
        evicting (queueing for host) others."""
        assert self.store.device is not None
        for j in range(KEYS):
            entry = self.store.host.entry(key((i + j) % KEYS))
            if entry is not None and not self.store.device.contains(entry.key):
                break
        if entry is not None:
            self.store.device.put(entry.key, NS, self.buffer[entry.offset : entry.offset + entry.size], entry.checksum)

    @rule(ids=st.lists(IDS, min_size=1, max_size=4, unique=True))
    def remove(self, ids: list[int]) -> None:
        assert self.store.flush(10)  # the disk writer settles: what the node holds is known
        held = 0
        for i in ids:
            record = self.store.records.get(key(i))
            in_table = record is not None and (record.queued is not None or record.demoting > 0)
            held += bool(self.store.tier_of(key(i))) or in_table
        assert self.store.remove([key(i) for i in ids]) == held
        self.gone.update(ids)

    @rule()
    def flush(self) -> None:
        assert self.store.flush(10)

    # -- moves in flight ------------------------------------------------------------------------
    @precondition(lambda self: self.mover is None)
    @rule(i=IDS, point=st.sampled_from(POINTS))
    def start_promotion(self, i: int, point: str) -> None:
        """A read of a block only a lower tier holds promotes it (the first such block from
        ``i`` on); pause it at ``point``."""
        below = [j for j in range(KEYS) if self.store.tier_of(key((i + j) % KEYS)) in ("disk", "device")]
        if below:
            target = (i + below[0]) % KEYS
            self._start(point, lambda: self._read([target]))

    @precondition(lambda self: self.mover is None)
    @rule(i=IDS, point=st.sampled_from(POINTS[1:]))
    def start_demotion(self, i: int, point: str) -> None:
        """Copy host blocks to HBM until it evicts one (queued for host), then drain the
        queue as a lease does; pause the drain at ``point``. A drain only moves blocks that
        left host meanwhile, so first push host blocks that HBM holds out with a put."""
        device = self.store.device
        assert device is not None
        in_hbm = device.keys()
        if all(self.store.host.entry(k) is not None for k in in_hbm):
            self.put_run((i + KEYS // 2) % KEYS, 8)
        for j in range(6):
            if self.store.records.queued_keys():
                break
            self.copy_to_device((i + j) % KEYS)
        if not self.store.records.queued_keys():
            return
        self._start(point, self.store._drain_device_demotions)

    @precondition(lambda self: self.mover is not None)
    @rule()
    def finish_move(self) -> None:
        assert self.mover is not None
        self.go.set()
        self.mover.join(PAUSE_S)
        assert not self.mover.is_alive(), "a move did not finish"
        self.mover = None
        assert not self.errors, self.errors

    # -- what must hold -----------------------------------------------------------------------------
    @invariant()
    def removed_blocks_stay_gone(self) -> None:
        for i in self.gone:
            assert self.store.lookup([key(i)]) == 0, f"removed block {i} came back"
            assert self.store.tier_of(key(i)) == "", f"removed block {i} is still in a tier"
        if self.mover is not None:
            return
        assert self.store.flush(10)
        with self.events_lock:
            last = {k: kind for kind, k in self.events}
        for i in self.gone:
            assert last.get(key(i), EventKind.REMOVED) is EventKind.REMOVED, f"block {i}: last event is not REMOVED"

    @invariant()
    def no_record_busy_between_calls(self) -> None:
        if self.mover is None:
            assert self.store.records.busy_keys() == []


MovesInFlight.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_block_record_moves_in_flight = MovesInFlight.TestCase
