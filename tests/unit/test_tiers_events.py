"""KV events of a tiered node name the tier where a block now lives: demotion to disk is
STORED on "disk", promotion back STORED on "host", a block left only in HBM STORED on
"device"; REMOVED only when the block leaves the node. Replaying the events gives exactly
the node's contents, tier by tier."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import DaemonConfig, StoreConfig, TierConfig
from kvpool.core.events import EventKind, KVEvent
from kvpool.daemon.cluster_events import event_to_vllm
from kvpool.daemon.node import PoolNode
from kvpool.directory.state import TIER_CODES
from kvpool.storage.tiered_store import TieredStore

BLOCK = 8000
NS = bytes(range(16))
HOST = StoreConfig(capacity_bytes=1 << 20, slab_bytes=1 << 18)  # 128 blocks of 8000 bytes


def key(i: int) -> bytes:
    """A block key as the daemon's store holds it: namespace digest || hash."""
    return NS + i.to_bytes(16, "little")


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


def put(store: TieredStore, buffer: np.ndarray, ids: list[int]) -> None:
    for start in range(0, len(ids), 16):
        chunk = ids[start : start + 16]
        grant = store.put_start(NS, [key(i) for i in chunk], BLOCK)
        sums = []
        for index, offset in grant.slots:
            buffer[offset : offset + BLOCK] = data(chunk[index])
            sums.append(checksum64(data(chunk[index])))
        if grant.put_id:
            assert store.put_commit(grant.put_id, sums).committed == len(sums)


def get(store: TieredStore, buffer: np.ndarray, ids: list[int]) -> int:
    grant = store.lease([key(i) for i in ids])
    for i, loc in zip(ids, grant.locations):
        np.testing.assert_array_equal(buffer[loc.offset : loc.offset + loc.size], data(i))
    if grant.lease_id:
        store.release(grant.lease_id)
    return len(grant.locations)


def replay(events: list[tuple[EventKind, bytes, str]]) -> dict[bytes, str]:
    """What a subscriber (the directory) believes: key -> tier."""
    view: dict[bytes, str] = {}
    for kind, k, tier in events:
        if kind is EventKind.STORED:
            view[k] = tier
        elif kind is EventKind.REMOVED:
            view.pop(k, None)
    return view


def actual(store: TieredStore, keys: list[bytes]) -> dict[bytes, str]:
    """Where each block really is: its fastest tier (host, then device, then disk)."""
    out: dict[bytes, str] = {}
    for k in keys:
        if store.host.entry(k) is not None:
            out[k] = "host"
        elif store.device is not None and store.device.contains(k):
            out[k] = "device"
        elif store.disk is not None and store.disk.contains(k):
            out[k] = "disk"
    return out


def history(events: list[tuple[EventKind, bytes, str]], k: bytes) -> list[tuple[EventKind, str]]:
    return [(kind, tier) for kind, kk, tier in events if kk == k]


def test_daemon_node_events_carry_the_tier_through_demotion_promotion_and_disk_eviction(
    tmp_path: pathlib.Path,
) -> None:
    (tmp_path / "arena").mkdir()
    config = DaemonConfig(
        arena_dir=str(tmp_path / "arena"),
        store=HOST,
        tiers=TierConfig(disk_dir=str(tmp_path / "disk"), disk_capacity_bytes=2 << 20, disk_slab_file_bytes=1 << 20),
    )  # disk: 2 files of 120 slots of 8 KiB, high/low 0.95/0.85
    node = PoolNode(config, FakeClock())
    store = node.store
    assert isinstance(store, TieredStore) and store.disk is not None and store.disk.wait_recovered(30)
    buffer = node.arena.view
    try:
        put(store, buffer, list(range(200)))
        assert store.flush()
        logged: list[KVEvent] = node.events.read_from(1, 0)
        assert [e.seq for e in logged] == list(range(1, len(logged) + 1))
        # the node's events name (namespace, hash); joined, they are the store's block keys
        events = [(e.kind, e.namespace + k, e.tier) for e in logged for k in e.hashes]
        assert {tier for _, _, tier in events} == {"host", "disk"}
        assert all(kind is EventKind.STORED for kind, _, _ in events)  # nothing left the node yet
        assert history(events, key(0)) == [(EventKind.STORED, "host"), (EventKind.STORED, "disk")]
        disk_event = next(e for e in logged if e.tier == "disk")
        assert event_to_vllm(disk_event)[-1] == "DISK" and TIER_CODES[disk_event.tier] == TIER_CODES["disk"]

        assert get(store, buffer, [0]) == 1  # promoted disk -> host
        events = [(e.kind, e.namespace + k, e.tier) for e in node.events.read_from(1, 0) for k in e.hashes]
        assert history(events, key(0))[-1] == (EventKind.STORED, "host")

        put(store, buffer, list(range(1000, 1300)))  # the disk fills past high: it evicts
        assert store.flush()
        assert store.disk.stats.evictions > 0
        events = [(e.kind, e.namespace + k, e.tier) for e in node.events.read_from(1, 0) for k in e.hashes]
        removed = {k for kind, k, _ in events if kind is EventKind.REMOVED}
        assert removed and all(not store.lookup([k]) for k in removed)  # REMOVED = gone from the node
        every = [key(i) for i in [*range(200), *range(1000, 1300)]]
        assert replay(events) == actual(store, every)

        on_disk = next(k for k, tier in actual(store, every).items() if tier == "disk")
        assert store.remove([on_disk]) == 1  # a client removal of a block only the disk holds
        last = node.events.read_from(node.events.last_seq, 0)[-1]
        assert last.kind is EventKind.REMOVED and (last.namespace, last.hashes) == (NS, (on_disk[16:],))
    finally:
        node.close()


def test_a_block_left_only_in_hbm_is_stored_on_device_then_back_on_host() -> None:
    pytest.importorskip("torch")
    events: list[tuple[EventKind, bytes, str]] = []

    def sink(kind: EventKind, keys: list[bytes], namespace: bytes, tier: str = "host", cause: str = "") -> None:
        events.extend((kind, k, tier) for k in keys)

    buffer = np.zeros(HOST.capacity_bytes, np.uint8)
    tiers = TierConfig(device_capacity_bytes=1 << 18, device="cpu")  # 32 blocks of HBM
    store = TieredStore(buffer, HOST, tiers, FakeClock(), on_event=sink, device_allow_cpu=True)
    device = store.device
    assert device is not None
    try:
        put(store, buffer, list(range(10)))
        for _ in range(2):  # the second hit copies them to HBM: no event (host is still the fastest copy)
            assert get(store, buffer, list(range(10))) == 10
        assert all(device.contains(key(i)) for i in range(10))
        put(store, buffer, list(range(100, 300)))  # host evicts 0..9; they stay in HBM
        assert store.host.entry(key(0)) is None and device.contains(key(0))
        assert history(events, key(0)) == [(EventKind.STORED, "host"), (EventKind.STORED, "device")]
        for _ in range(2):  # 40 hot blocks push 0..9 out of HBM: demoted back into host
            assert get(store, buffer, list(range(260, 300))) == 40
        assert not device.contains(key(0)) and store.host.entry(key(0)) is not None
        assert history(events, key(0)) == [
            (EventKind.STORED, "host"),
            (EventKind.STORED, "device"),
            (EventKind.STORED, "host"),
        ]
        assert get(store, buffer, [0]) == 1  # bytes intact after the round trip
        every = [key(i) for i in [*range(10), *range(100, 300)]]
        assert replay(events) == actual(store, every)
    finally:
        store.close()
