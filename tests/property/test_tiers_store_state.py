"""Hypothesis state machine over the tiered store (host + disk, and a cpu device tier):
random put / get / hold lease / pin / remove / evict / flush / corrupt / restart sequences
never return wrong bytes, never exceed a tier's capacity, and never evict a leased or
hard-pinned block."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig, TierConfig
from kvpool.core.errors import CapacityExhausted
from kvpool.storage.tiered_store import TieredStore

BLOCK = 3000
NS = bytes(range(16))
HOST = StoreConfig(capacity_bytes=1 << 16, slab_bytes=1 << 14, lease_ttl_ms=1000, put_ttl_ms=1000)  # 20 blocks
IDS = st.integers(0, 39)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


class TieredStoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvpool-tiers-state-")
        self.clock = FakeClock()
        self.held: list[tuple[int, float, list[tuple[int, int, int]]]] = []  # lease, expiry, (id, off, size)
        self.hard_pinned: set[int] = set()
        self.soft_pinned: dict[int, float] = {}  # id -> pinned until (ms)
        self.abandoned: set[int] = set()  # put started, writer "died" before commit
        self.use_device = False
        self.asked = self.served = 0  # blocks named by leases / leased, since the last open
        self._open()

    def _open(self) -> None:
        self.buffer = np.zeros(HOST.capacity_bytes, np.uint8)
        tiers = TierConfig(
            disk_dir=self.dir,
            disk_capacity_bytes=1 << 16,  # 1 file of 64 KiB: 15 disk slots
            disk_slab_file_bytes=1 << 16,
            disk_io_threads=2,
            write_behind_queue_blocks=8,
            disk_policy="s3fifo",
            device_capacity_bytes=(1 << 14) if self.use_device else 0,
            device="cpu",
        )
        self.store = TieredStore(self.buffer, HOST, tiers, self.clock, device_allow_cpu=True)

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(first=IDS, n=st.integers(1, 12))
    def put_run(self, first: int, n: int) -> None:
        self.put([(first + j) % 40 for j in range(n)])

    @rule(ids=st.lists(IDS, min_size=1, max_size=6, unique=True))
    def put(self, ids: list[int]) -> None:
        try:
            grant = self.store.put_start(NS, [key(i) for i in ids], BLOCK)
        except CapacityExhausted:
            return  # everything evictable is leased or pinned: the put fails whole
        sums = []
        for index, offset in grant.slots:
            self.buffer[offset : offset + BLOCK] = data(ids[index])
            sums.append(checksum64(data(ids[index])))
        if grant.put_id:
            assert self.store.put_commit(grant.put_id, sums).checksum_failed == []

    @rule(first=IDS, n=st.integers(1, 3), hold=st.booleans())
    def get_run(self, first: int, n: int, hold: bool) -> None:
        self.get([(first + j) % 40 for j in range(n)], hold)

    @rule(ids=st.lists(IDS, min_size=1, max_size=3, unique=True), hold=st.booleans())
    def get(self, ids: list[int], hold: bool) -> None:
        try:
            grant = self.store.lease([key(i) for i in ids])
        except CapacityExhausted:
            return
        self.asked += len(ids)
        self.served += len(grant.locations)
        held = []
        for i, loc in zip(ids, grant.locations):
            assert loc.size == BLOCK
            np.testing.assert_array_equal(self.buffer[loc.offset : loc.offset + BLOCK], data(i))
            held.append((i, loc.offset, loc.size))
        if not grant.lease_id:
            return
        if hold:
            self.held.append((grant.lease_id, grant.expires_ms, held))
        else:
            self.store.release(grant.lease_id)

    @precondition(lambda self: bool(self.held))
    @rule()
    def release_oldest(self) -> None:
        lease_id, _, _ = self.held.pop(0)
        self.store.release(lease_id)

    @rule(i=IDS)
    def pin_hard(self, i: int) -> None:
        if self.store.pin([key(i)], None):
            self.hard_pinned.add(i)

    @rule(i=IDS, ttl_ms=st.sampled_from([100, 5000]))
    def pin_soft(self, i: int, ttl_ms: int) -> None:
        if self.store.pin([key(i)], ttl_ms):
            until = self.clock.now_ms() + ttl_ms
            self.soft_pinned[i] = max(until, self.soft_pinned.get(i, 0.0))

    @rule(i=IDS)
    def unpin(self, i: int) -> None:
        self.store.unpin([key(i)])
        self.hard_pinned.discard(i)
        self.soft_pinned.pop(i, None)

    @rule(ids=st.lists(IDS, min_size=1, max_size=3, unique=True))
    def abandon_put(self, ids: list[int]) -> None:
        """A writer reserves slots, scribbles garbage into them and dies before committing."""
        try:
            grant = self.store.put_start(NS, [key(i) for i in ids], BLOCK)
        except CapacityExhausted:
            return
        for index, offset in grant.slots:
            self.buffer[offset : offset + BLOCK] = 0xAB
            self.abandoned.add(ids[index])

    @rule(ids=st.lists(IDS, min_size=1, max_size=4, unique=True))
    def remove(self, ids: list[int]) -> None:
        self.store.remove([key(i) for i in ids])
        self.hard_pinned.difference_update(ids)
        for i in ids:
            self.soft_pinned.pop(i, None)
        assert self.store.lookup([key(ids[0])]) == 0

    @rule(ms=st.sampled_from([10, 600, 1500]))
    def advance_clock(self, ms: int) -> None:
        self.clock.advance(ms)
        self.store.sweep()
        now = self.clock.now_ms()
        self.held = [h for h in self.held if h[1] > now]
        if ms >= HOST.put_ttl_ms:  # the dead writers' puts were reclaimed by the sweep
            assert self.store.summary()["pending_puts"] == 0
            self.abandoned.clear()

    @rule()
    def flush(self) -> None:
        assert self.store.flush(10)

    @rule(i=IDS, at=st.integers(0, BLOCK - 1))
    def corrupt_on_disk(self, i: int, at: int) -> None:
        disk = self.store.disk
        assert disk is not None
        disk.flush()
        entry = disk._index.get(key(i))
        if entry is None:
            return
        with open(disk._file_path(entry.file), "r+b") as fh:
            fh.seek(entry.offset + at)
            byte = fh.read(1)[0]
            fh.seek(entry.offset + at)
            fh.write(bytes([byte ^ 0xFF]))
        device = self.store.device
        if self.store.host.entry(key(i)) is None and (device is None or not device.contains(key(i))):
            failures = disk.stats.checksum_failures
            grant = self.store.lease([key(i)])
            self.asked += 1
            assert grant.locations == []  # detected, dropped, a miss: never the flipped bytes
            assert disk.stats.checksum_failures == failures + 1
            assert not disk.contains(key(i))

    @rule(use_device=st.booleans())
    def restart(self, use_device: bool) -> None:
        """The process goes away (host arena, leases and pins with it); the disk stays."""
        self.store.close()
        self.held.clear()
        self.hard_pinned.clear()
        self.soft_pinned.clear()
        self.abandoned.clear()
        self.use_device = use_device
        self.asked = self.served = 0
        self._open()

    @invariant()
    def capacities_hold(self) -> None:
        assert self.store.used_bytes() <= HOST.capacity_bytes
        disk = self.store.disk
        assert disk is not None and disk.used_bytes <= disk.capacity_bytes
        if self.store.device is not None:
            assert self.store.device.used_bytes <= self.store.device.capacity_bytes

    @invariant()
    def leased_and_hard_pinned_blocks_stay_put(self) -> None:
        for _, _, blocks in self.held:
            for i, offset, size in blocks:
                np.testing.assert_array_equal(self.buffer[offset : offset + size], data(i))
        for i in self.hard_pinned:
            entry = self.store.host.entry(key(i))
            assert entry is not None and entry.hard_pin
        now = self.clock.now_ms()
        for i, until in self.soft_pinned.items():
            if until > now:
                assert self.store.host.entry(key(i)) is not None, f"soft-pinned block {i} evicted before its TTL"

    @invariant()
    def abandoned_writes_are_never_visible(self) -> None:
        for i in self.abandoned:
            entry = self.store.host.entry(key(i))
            # committed later by a real writer is fine; the garbage never is
            if entry is not None:
                np.testing.assert_array_equal(self.buffer[entry.offset : entry.offset + BLOCK], data(i))

    @invariant()
    def stats_add_up(self) -> None:
        s = self.store.summary()
        assert (s["hits"], s["misses"]) == (self.served, self.asked - self.served)
        host, disk = s["tiers"]["host"], s["tiers"]["disk"]
        assert s["hits"] == host["hits"] + host["lower_hits"] and host["lower_hits"] <= host["promotions"]
        assert s["misses"] == host["misses"] - host["lower_hits"]
        assert disk["used_bytes"] <= disk["capacity_bytes"] and disk["blocks"] >= 0


TieredStoreMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_tiered_store_state_machine = TieredStoreMachine.TestCase
