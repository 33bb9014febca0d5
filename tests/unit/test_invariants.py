"""Debug invariants (kvpool/core/invariants.py) can fail: each structure's state is
corrupted on purpose and its ``check_invariants`` must name the broken invariant; with
debug mode on, the next operation on a corrupted store raises by itself."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvpool.core import invariants
from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig, TierConfig
from kvpool.core.hashing import HASH_SCHEME, block_hashes
from kvpool.core.invariants import InvariantViolated
from kvpool.core.spec import KVSpec, Namespace
from kvpool.directory.index import NodeRecord
from kvpool.directory.leases import LeaseTable
from kvpool.directory.placement import check_placement
from kvpool.directory.state import DirectoryState
from kvpool.storage.allocator import SlabAllocator
from kvpool.storage.block_record import BlockRecord, BlockTable
from kvpool.storage.host_store import HostStore
from kvpool.storage.tiered_store import TieredStore

BLOCK = 4000
NS = bytes(16)
HOST = StoreConfig(capacity_bytes=1 << 18, slab_bytes=1 << 16)


def key(i: int) -> bytes:
    return NS + i.to_bytes(16, "little")


def fill(store: HostStore | TieredStore, buffer: np.ndarray, ids: list[int]) -> None:
    grant = store.put_start(NS, [key(i) for i in ids], BLOCK)
    sums = []
    for index, offset in grant.slots:
        block = np.full(BLOCK, ids[index] % 251, np.uint8)
        buffer[offset : offset + BLOCK] = block
        sums.append(checksum64(block))
    store.put_commit(grant.put_id, sums)


def violated(check: Callable[[], None], structure: str, invariant: str) -> None:
    with pytest.raises(InvariantViolated) as err:
        check()
    assert (err.value.structure, err.value.invariant) == (structure, invariant), str(err.value)
    assert err.value.code.wire_name == "INTERNAL" and invariant in str(err.value)


@pytest.fixture
def host() -> tuple[HostStore, np.ndarray]:
    buffer = np.zeros(HOST.capacity_bytes, np.uint8)
    store = HostStore(buffer, HOST, FakeClock())
    fill(store, buffer, [1, 2, 3])
    store.check_invariants()  # a healthy store passes
    return store, buffer


def test_host_store_namespace_bytes(host: tuple[HostStore, np.ndarray]) -> None:
    store, _ = host
    store._ns_bytes[NS] += 1
    violated(store.check_invariants, "HostStore", "namespace bytes add up")


def test_host_store_shared_slot(host: tuple[HostStore, np.ndarray]) -> None:
    store, _ = host
    store._index[key(2)].offset = store._index[key(1)].offset
    violated(store.check_invariants, "HostStore", "no two blocks share a slot")


def test_host_store_lease_counts(host: tuple[HostStore, np.ndarray]) -> None:
    store, _ = host
    grant = store.lease([key(1)])
    store._index[key(1)].leases = 0
    violated(store.check_invariants, "HostStore", "lease counts match the leases")
    store._index[key(1)].leases = 1
    store.release(grant.lease_id)


def test_host_store_pending_keys(host: tuple[HostStore, np.ndarray]) -> None:
    store, _ = host
    store._pending_keys.add(key(9))
    violated(store.check_invariants, "HostStore", "pending keys are the pending puts' keys")


def test_allocator_accounting() -> None:
    alloc = SlabAllocator(1 << 18, 1 << 16)
    offsets = [alloc.alloc(BLOCK) for _ in range(5)]
    alloc.check_invariants()
    alloc.used_bytes += 64
    violated(alloc.check_invariants, "SlabAllocator", "used bytes are the used slots")
    alloc.used_bytes -= 64
    assert offsets[0] is not None
    alloc._slab_free_slots[alloc.slab_of(offsets[0])].append(0)  # a used slot listed free too
    violated(alloc.check_invariants, "SlabAllocator", "used and free slots fill the slab")


def test_debug_mode_checks_after_each_operation(host: tuple[HostStore, np.ndarray]) -> None:
    """The decorator is the one place per operation: a corrupted store fails its next call
    with debug mode on, and is not checked with it off (production)."""
    store, _ = host
    store._ns_bytes[NS] += 1
    assert invariants.enabled()  # tests/conftest.py turns it on for the suite
    violated(lambda: store.lookup([key(1)]) and store.unpin([key(1)]), "HostStore", "namespace bytes add up")
    invariants.set_enabled(False)
    try:
        assert store.unpin([key(1)]) == 0  # off: no check, the call just runs
    finally:
        invariants.set_enabled(True)


def test_debug_mode_from_the_environment() -> None:
    invariants.set_enabled(False)
    try:
        invariants.enable_from_environ({})
        assert not invariants.enabled()
        invariants.enable_from_environ({invariants.ENV_VAR: "1"})
        assert invariants.enabled()
    finally:
        invariants.set_enabled(True)


def test_block_table() -> None:
    table = BlockTable(ghost_keys=4)
    table.prepare_remove([key(1)])
    table.check_invariants()
    table._records[key(2)] = BlockRecord()  # idle: should have been deleted
    violated(table.check_invariants, "BlockTable", "a record is not idle")
    del table._records[key(2)]
    table._removing += 1
    violated(table.check_invariants, "BlockTable", "removes in flight add up")
    table._removing -= 1
    table._records[key(1)].moved_to = "tape"
    violated(table.check_invariants, "BlockTable", "moved_to names a lower tier")


@pytest.fixture
def tiered(tmp_path: pathlib.Path) -> Iterator[tuple[TieredStore, np.ndarray]]:
    buffer = np.zeros(HOST.capacity_bytes, np.uint8)
    tiers = TierConfig(
        disk_dir=str(tmp_path),
        disk_capacity_bytes=4 << 20,
        disk_slab_file_bytes=1 << 20,
        disk_io_threads=1,
        device_capacity_bytes=1 << 16,
        device="cpu",
    )
    store = TieredStore(buffer, HOST, tiers, FakeClock(), device_allow_cpu=True)
    assert store.disk is not None and store.disk.wait_recovered(10)
    yield store, buffer
    store.close()


def test_disk_state(tiered: tuple[TieredStore, np.ndarray]) -> None:
    store, buffer = tiered
    for start in range(0, 100, 20):  # 64 fit the host: the rest push blocks down to disk
        fill(store, buffer, list(range(start, start + 20)))
    assert store.flush(10)
    disk = store.disk
    assert disk is not None and len(disk) > 0
    store.check_invariants()
    entry = next(iter(disk._index.values()))
    del disk._st.slot_owner[disk._st.slot_key(entry)]
    violated(store.check_invariants, "DiskState", "an indexed block owns its slot")
    disk._st.slot_owner[disk._st.slot_key(entry)] = entry
    disk._slots.used_bytes += 4096
    violated(store.check_invariants, "DiskSlots", "used bytes are the used slots")
    disk._slots.used_bytes -= 4096


def test_device_tier(tiered: tuple[TieredStore, np.ndarray]) -> None:
    store, _ = tiered
    device = store.device
    assert device is not None
    for i in range(3):
        block = np.full(BLOCK, i, np.uint8)
        assert device.put(key(i), NS, block, checksum64(block))
    device._index[key(1)].offset = device._index[key(0)].offset
    violated(device.check_invariants, "DeviceTier", "no two blocks share a slot")
    violated(store.check_invariants, "DeviceTier", "no two blocks share a slot")


SPEC = KVSpec(model="tiny", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=4)
SPACE = Namespace(SPEC, b"t")
NS_ROW = (SPACE.digest(), SPEC.digest(), json.dumps(SPEC.to_dict()))
KEYS = block_hashes(SPACE, list(range(4 * 16)))


def node(name: str) -> NodeRecord:
    return NodeRecord(name, f"{name}:1", f"{name}:2", "tcp", "h-" + name, 1 << 30, 0, 1)


def directory() -> DirectoryState:
    state = DirectoryState(FakeClock())
    state.register(node("a"), HASH_SCHEME, [NS_ROW], KEYS[:10], b"")
    state.register(node("b"), HASH_SCHEME, [NS_ROW], KEYS[5:12], b"")
    state.check_invariants()
    return state


def test_directory_index() -> None:
    state = directory()
    a = state.node("a")
    assert a is not None
    a.keys[KEYS[13]] = 0  # a node's key the holder map does not know
    violated(state.check_invariants, "BlockIndex", "every key of an attached node is in the holder map")
    del a.keys[KEYS[13]]
    state._index._holders[KEYS[14]] = {}
    violated(state.check_invariants, "BlockIndex", "a held key has a holder")


def test_directory_registry() -> None:
    state = directory()
    a = state.node("a")
    assert a is not None
    a.alive = False
    violated(state.check_invariants, "DirectoryState", "a registered node is alive")


def test_directory_leases() -> None:
    table = LeaseTable(max_leases=2)
    table.grant(KEYS[:3], 1000, 0.0)
    table.check_invariants()
    table._leased_count[KEYS[0]] += 1
    violated(table.check_invariants, "LeaseTable", "lease counts match the leases")


def test_placement() -> None:
    a, b = node("a"), node("b")
    check_placement([a, b], [a, b], None, 2)
    violated(lambda: check_placement([a, a], [a, b], None, 2), "placement", "distinct nodes")
    violated(lambda: check_placement([a, b], [a, b], None, 1), "placement", "at most the replicas asked for")
    b.alive = False
    violated(lambda: check_placement([b], [a, b], None, 1), "placement", "only live nodes")


def test_an_operation_defined_with_debug_off_is_left_as_it_is() -> None:
    """Production pays nothing: with the switch off when a class is defined, its operations
    are the plain functions (no wrapper, no attribute test)."""
    invariants.set_enabled(False)
    try:

        def operation(self: object) -> int:
            return 1

        assert invariants.checked_after(operation) is operation
    finally:
        invariants.set_enabled(True)


class _Counted:
    """A structure that counts its checks and can be broken on purpose."""

    def __init__(self) -> None:
        self.checks = 0
        self.broken = False

    def check_invariants(self) -> None:
        self.checks += 1
        invariants.require("Counted", "not broken", not self.broken)

    @invariants.checked_after
    def operate(self) -> None:
        pass


def test_sampled_mode_checks_a_share_of_operations_and_still_catches_a_lasting_break(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sampled mode (the tests' daemons): a fresh structure is checked by its first
    operation; after a check taking t, none until t / SAMPLED_SHARE has passed; a rule that
    stays broken is caught by the first operation after that."""
    now_s = [100.0]

    def fake_monotonic() -> float:
        now_s[0] += 0.001  # every reading of the clock advances it by 1 ms
        return now_s[0]

    monkeypatch.setattr(invariants.time, "monotonic", fake_monotonic)
    invariants.set_sampled(True)
    try:
        thing = _Counted()
        thing.operate()
        assert thing.checks == 1  # first operation: checked; the check "took" 1 ms
        for _ in range(3):
            thing.operate()  # each at +1 ms: inside the 10 ms the check bought
        assert thing.checks == 1
        thing.broken = True
        with pytest.raises(InvariantViolated):
            for _ in range(20):
                thing.operate()
        assert thing.checks == 2
    finally:
        invariants.set_sampled(False)


def test_sampled_from_the_environment_never_weakens_checks_already_on() -> None:
    """A test process (checks on after every operation) that runs the CLI in-process with
    KVPOOL_DEBUG_INVARIANTS=sampled in its environment keeps checking every operation."""
    assert invariants.enabled() and not invariants.DEBUG.sampled
    invariants.enable_from_environ({invariants.ENV_VAR: "sampled"})
    assert invariants.enabled() and not invariants.DEBUG.sampled
    thing = _Counted()
    thing.operate()
    thing.operate()
    assert thing.checks == 2
