"""HostStore as a state machine (hypothesis) against a model, driven by a FakeClock.

Two block-size classes share one small arena (as two namespaces would). Random
sequences of put_start / commit (good or corrupt checksums) / abort / lease /
release / remove / pin / unpin / clock advance / sweep. After every step:

- every visible block's bytes are the bytes its writer committed (never wrong bytes);
- bytes under a live lease never change, even after the block was removed or space was needed;
- leased, hard-pinned and live soft-pinned blocks are never evicted;
- a started but uncommitted put is never visible; a corrupt commit stores nothing;
- used bytes never exceed capacity and equal the slots held;
- lookup is the longest present prefix;
- CapacityExhausted with nothing evictable loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig
from kvpool.core.errors import CapacityExhausted, LeaseExpired, NotFound
from kvpool.storage.allocator import slot_size_for
from kvpool.storage.host_store import HostStore

SMALL, LARGE = 200, 500  # two size classes (namespaces with different block sizes): slots 256 and 512
SLAB = 1024  # 4 small or 2 large slots per slab
SLABS = 2
KEYS = [bytes([i]) * 16 for i in range(12)]
NS = b"\x07" * 16
LEASE_TTL_MS = 100
PUT_TTL_MS = 150


def size_of(key: bytes) -> int:
    return SMALL if key[0] < 7 else LARGE


def content(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@dataclass
class ModelPut:
    slots: list[tuple[int, bytes, int, int]]  # (request index, key, offset, content seed)
    deadline_ms: float
    size: int


@dataclass
class ModelLease:
    blocks: list[tuple[bytes, int, int, int]]  # (key, offset, content seed, size)
    expires_ms: float


class HostStoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.config = StoreConfig(
            capacity_bytes=SLABS * SLAB, slab_bytes=SLAB, high_watermark=0.5, low_watermark=0.3,
            lease_ttl_ms=LEASE_TTL_MS, put_ttl_ms=PUT_TTL_MS,
        )  # fmt: skip
        self.buffer = np.zeros(SLABS * SLAB, dtype=np.uint8)
        self.store = HostStore(self.buffer, self.config, self.clock)
        self.committed: dict[bytes, int] = {}  # key -> content seed, as the model believes present
        self.offset_of: dict[bytes, int] = {}  # key -> arena offset of its committed entry
        self.puts: dict[int, ModelPut] = {}
        self.leases: dict[int, ModelLease] = {}
        self.hard: set[bytes] = set()
        self.soft_until: dict[bytes, float] = {}
        self.seed = 0

    # -- helpers -------------------------------------------------------------------------
    def _protected(self, key: bytes) -> bool:
        # a lease protects the entry it was granted on: after a remove and a re-put, the key's new
        # entry (another offset) is not covered by a lease on the old, doomed one
        offset = self.offset_of[key]
        leased = any((key, offset) == (k, off) for lease in self.leases.values() for k, off, _, _ in lease.blocks)
        return leased or key in self.hard or self.soft_until.get(key, 0.0) > self.clock.now_ms()

    def _account_evictions(self) -> None:
        """Blocks the model thinks present but the store dropped must have been evictable."""
        present = set(self.store.snapshot_keys())
        for key in list(self.committed):
            if key not in present:
                assert not self._protected(key), "a leased or pinned block was evicted"
                del self.committed[key]
                self.hard.discard(key)
                self.soft_until.pop(key, None)

    # -- rules ---------------------------------------------------------------------------
    @rule(picks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5))
    def put_start(self, picks: list[bytes]) -> None:
        size = size_of(picks[0])
        picks = [k for k in picks if size_of(k) == size]  # one put = one namespace = one block size
        before = dict(self.committed)
        anything_evictable = any(not self._protected(k) for k in self.committed)
        try:
            grant = self.store.put_start(NS, picks, size)
        except CapacityExhausted:
            present = set(self.store.snapshot_keys())
            if not anything_evictable:
                assert present == set(before), "a failed put lost stored blocks"
            self._account_evictions()
            return
        self._account_evictions()
        for i in grant.already_present:  # reported present, so still present: the writer skips it
            assert picks[i] in before and picks[i] in self.committed
        pending = {k for p in self.puts.values() for _, k, _, _ in p.slots}
        for i in grant.in_flight:
            assert picks[i] in pending or picks[i] in picks[:i]
        slots = []
        for index, offset in grant.slots:
            assert picks[index] not in self.committed and picks[index] not in pending
            assert offset >= 0 and offset + size <= SLABS * SLAB
            self.seed += 1
            self.buffer[offset : offset + size] = content(self.seed, size)  # the writer's copy
            slots.append((index, picks[index], offset, self.seed))
        if grant.put_id:
            self.puts[grant.put_id] = ModelPut(slots, self.clock.now_ms() + PUT_TTL_MS, size)
        else:
            assert not grant.slots

    @rule(picks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
    def put_and_commit(self, picks: list[bytes]) -> None:
        """The common path: a put committed at once by a healthy writer."""
        before = set(self.puts)
        self.put_start(picks)
        for put_id in set(self.puts) - before:
            self._commit(put_id, set())

    @precondition(lambda self: bool(self.puts))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        put_id = data.draw(st.sampled_from(sorted(self.puts)))
        corrupt = data.draw(st.sets(st.sampled_from([s[0] for s in self.puts[put_id].slots])))
        self._commit(put_id, corrupt)

    def _commit(self, put_id: int, corrupt: set[int]) -> None:
        put = self.puts.pop(put_id)
        sums = [checksum64(content(seed, put.size)) ^ (index in corrupt) for index, _, _, seed in put.slots]
        result = self.store.put_commit(put_id, sums)
        assert sorted(result.checksum_failed) == sorted(corrupt)
        assert result.committed == len(put.slots) - len(corrupt)
        for index, key, offset, seed in put.slots:
            if index in corrupt:
                assert self.store.entry(key) is None, "a block with a bad checksum became visible"
            else:
                self.committed[key] = seed
                self.offset_of[key] = offset

    @precondition(lambda self: bool(self.puts))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        put_id = data.draw(st.sampled_from(sorted(self.puts)))
        del self.puts[put_id]
        self.store.put_abort(put_id)

    def _present_first(self, data: st.DataObject, max_size: int) -> list[bytes]:
        """Keys to act on, led by a present one when there is one (random keys rarely are)."""
        picks = data.draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=max_size))
        use_present: bool = bool(self.committed) and data.draw(st.booleans())
        if use_present:
            picks[0] = data.draw(st.sampled_from(sorted(self.committed)))
        return picks

    @precondition(lambda self: any(k in self.committed for lease in self.leases.values() for k, *_ in lease.blocks))
    @rule(data=st.data())
    def remove_while_leased(self, data: st.DataObject) -> None:
        """A reader still copies a block while another client removes it: the slot must wait."""
        leased = sorted({k for lease in self.leases.values() for k, *_ in lease.blocks if k in self.committed})
        key = data.draw(st.sampled_from(leased))
        assert self.store.remove([key]) == 1
        del self.committed[key]
        self.hard.discard(key)
        self.soft_until.pop(key, None)

    @rule(data=st.data())
    def lease(self, data: st.DataObject) -> None:
        picks = self._present_first(data, 4)
        grant = self.store.lease(picks)
        expected = 0
        for key in picks:
            if key not in self.committed:
                break
            expected += 1
        assert len(grant.locations) == expected, "lease is not the longest present prefix"
        blocks = []
        for key, loc in zip(picks, grant.locations, strict=False):
            seed = self.committed[key]
            got = self.buffer[loc.offset : loc.offset + loc.size]
            assert loc.size == size_of(key)
            assert np.array_equal(got, content(seed, loc.size)), "wrong bytes served"
            assert checksum64(got) == loc.checksum
            blocks.append((key, loc.offset, seed, loc.size))
        if grant.lease_id:
            self.leases[grant.lease_id] = ModelLease(blocks, self.clock.now_ms() + LEASE_TTL_MS)
        else:
            assert expected == 0

    @precondition(lambda self: bool(self.leases))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        del self.leases[lease_id]
        self.store.release(lease_id)  # never swept without the model knowing: must succeed

    @rule(lease_id=st.integers(min_value=10_000, max_value=10_010))
    def release_unknown(self, lease_id: int) -> None:
        try:
            self.store.release(lease_id)
        except LeaseExpired:
            return
        raise AssertionError("releasing an unknown lease must raise LeaseExpired")

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        picks = self._present_first(data, 3)
        expected = len({k for k in picks if k in self.committed})
        assert self.store.remove(picks) == expected
        for key in picks:
            self.committed.pop(key, None)
            self.hard.discard(key)
            self.soft_until.pop(key, None)

    @rule(data=st.data(), ttl=st.sampled_from([None, 50, 500]))
    def pin(self, data: st.DataObject, ttl: int | None) -> None:
        picks = self._present_first(data, 3)
        changed = self.store.pin(picks, ttl)
        assert changed == sum(1 for k in picks if k in self.committed)
        for key in picks:
            if key in self.committed:
                if ttl is None:
                    self.hard.add(key)
                else:
                    until = self.clock.now_ms() + ttl
                    self.soft_until[key] = max(self.soft_until.get(key, 0.0), until)

    @rule(picks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def unpin(self, picks: list[bytes]) -> None:
        self.store.unpin(picks)
        for key in picks:
            self.hard.discard(key)
            self.soft_until.pop(key, None)

    @rule(delta=st.sampled_from([1, 40, 120]))
    def advance(self, delta: int) -> None:
        self.clock.advance(delta)

    @rule()
    def sweep(self) -> None:
        now = self.clock.now_ms()
        want_leases = sorted(lid for lid, lease in self.leases.items() if lease.expires_ms <= now)
        want_puts = sorted(pid for pid, put in self.puts.items() if put.deadline_ms <= now)
        assert self.store.sweep() == (len(want_leases), len(want_puts))
        for lid in want_leases:
            del self.leases[lid]
            try:
                self.store.release(lid)
            except LeaseExpired:
                pass
            else:
                raise AssertionError("an expired lease could still be released after sweep")
        for pid in want_puts:
            put = self.puts.pop(pid)
            try:
                self.store.put_commit(pid, [checksum64(content(seed, put.size)) for _, _, _, seed in put.slots])
            except NotFound:
                pass
            else:
                raise AssertionError("a reclaimed put could still be committed")

    @rule(picks=st.lists(st.sampled_from(KEYS), min_size=0, max_size=6))
    def lookup(self, picks: list[bytes]) -> None:
        n = 0
        for key in picks:
            if key not in self.committed:
                break
            n += 1
        assert self.store.lookup(picks) == n

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def visible_blocks_hold_their_committed_bytes(self) -> None:
        self._account_evictions()
        present = set(self.store.snapshot_keys())
        assert present == set(self.committed)
        for key, seed in self.committed.items():
            entry = self.store.entry(key)
            assert entry is not None
            assert entry.offset == self.offset_of[key]
            data = self.buffer[entry.offset : entry.offset + entry.size]
            assert entry.size == size_of(key)
            assert np.array_equal(data, content(seed, entry.size)), "a visible block's bytes changed"
            assert checksum64(data) == entry.checksum

    @invariant()
    def leased_bytes_never_change(self) -> None:
        for lease in self.leases.values():
            for _key, offset, seed, size in lease.blocks:
                assert np.array_equal(self.buffer[offset : offset + size], content(seed, size))

    @invariant()
    def pending_puts_are_invisible(self) -> None:
        for put in self.puts.values():
            for _, key, _, _ in put.slots:
                assert self.store.entry(key) is None

    @invariant()
    def used_bytes_are_exact_and_bounded(self) -> None:
        used = self.store.used_bytes()
        assert 0 <= used <= SLABS * SLAB
        held: dict[int, int] = {}  # offset -> block size of every slot the model says is taken
        for key in self.committed:
            entry = self.store.entry(key)
            assert entry is not None
            held[entry.offset] = entry.size
        for lease in self.leases.values():  # removed-but-leased blocks keep their slots
            for _, offset, _, size in lease.blocks:
                held[offset] = size
        for put in self.puts.values():  # uncommitted puts hold slots until committed, aborted or swept
            for _, _, offset, _ in put.slots:
                held[offset] = put.size
        assert used == sum(slot_size_for(size) for size in held.values())


HostStoreMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestHostStore = HostStoreMachine.TestCase
