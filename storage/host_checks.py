"""The host store's invariants, checked in debug mode (``kvpool.core.invariants``) after
each of its operations: ``HostStore.check_invariants`` calls ``check_host_store`` under the
store's lock. Kept beside the store (it reads the store's private state) so the store's
own module stays about its operations."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpool.core.invariants import require
from kvpool.storage.allocator import slot_size_for

if TYPE_CHECKING:
    from kvpool.storage.host_store import Entry, HostStore


def _bump(counts: dict[Any, int], key: Any, delta: int) -> None:
    counts[key] = counts.get(key, 0) + delta


def check_host_store(store: HostStore) -> None:
    """Every slot is owned by exactly one committed, doomed (leased, removed) or pending
    block, of its size class, in a segment of its namespace's owner; lease counts are the
    leases holding each entry; bytes per namespace and tenant add up and stay within their
    quotas; the tables are bounded."""
    name = "HostStore"
    store._alloc.check_invariants()
    owner: dict[int, bytes] = {}
    slot_bytes = 0
    ns_bytes: dict[bytes, int] = {}

    def own(offset: int, size: int, key: bytes, namespace: bytes) -> None:
        nonlocal slot_bytes
        require(name, "no two blocks share a slot", offset not in owner, lambda: f"offset {offset}")
        seg_owner = store._alloc.segment_owner(store._alloc.segment_of(offset))
        ns_owner = store._owner_of.get(namespace, 0)
        require(
            name,
            "a block's slot lies in a segment of its namespace's owner",
            seg_owner == ns_owner,
            lambda: f"{key.hex()} at {offset}: segment owner {seg_owner}, namespace owner {ns_owner}",
        )
        require(
            name,
            "a block's slot is of its size class",
            store._alloc.slot_bytes_at(offset) == slot_size_for(size),
            lambda: f"{key.hex()} at {offset}: class {store._alloc.slot_bytes_at(offset)}, size {size}",
        )
        owner[offset] = key
        slot_bytes += slot_size_for(size)

    refs: dict[int, int] = {}
    leased: dict[int, Entry] = {}
    for lease in store._leases.values():
        for entry in lease.entries:
            refs[id(entry)] = refs.get(id(entry), 0) + 1
            leased[id(entry)] = entry
    for key, entry in store._index.items():
        require(name, "an entry is indexed under its key", entry.key == key, key.hex)
        require(name, "an indexed entry is not doomed", not entry.doomed, key.hex)
        require(
            name,
            "lease counts match the leases",
            entry.leases == refs.get(id(entry), 0),
            key.hex,
        )
        own(entry.offset, entry.size, key, entry.namespace)
        _bump(ns_bytes, entry.namespace, entry.size)
    for ident, entry in leased.items():
        if store._index.get(entry.key) is entry:
            continue
        require(name, "a leased block that left the index is doomed", entry.doomed, entry.key.hex)
        require(name, "lease counts match the leases", entry.leases == refs[ident], entry.key.hex)
        own(entry.offset, entry.size, entry.key, entry.namespace)
    pending_keys: set[bytes] = set()
    for put in [*store._pending.values(), *store._verifying.values()]:  # being verified: still theirs
        for key, offset in zip(put.keys, put.offsets, strict=True):
            require(name, "a key is written by one put at a time", key not in pending_keys, key.hex)
            pending_keys.add(key)
            own(offset, put.block_bytes, key, put.namespace)
        require(name, "a pending put has an index per slot", len(put.indices) == len(put.keys))
        _bump(ns_bytes, put.namespace, len(put.keys) * put.block_bytes)
    require(name, "pending keys are the pending puts' keys", pending_keys == store._pending_keys)
    require(name, "allocated bytes are the blocks' slots", slot_bytes == store._alloc.used_bytes)
    require(name, "namespace bytes add up", ns_bytes == store._ns_bytes, lambda: f"{ns_bytes} != {store._ns_bytes}")
    tenant_bytes: dict[str, int] = {}
    for ns, used in ns_bytes.items():
        owner_tenant = store._tenant_of.get(ns)
        if owner_tenant is not None:
            _bump(tenant_bytes, owner_tenant[0], used)
        elif store.config.namespace_quota_bytes:
            require(name, "a namespace stays within its quota", used <= store.config.namespace_quota_bytes)
    require(name, "tenant bytes add up", tenant_bytes == store._tenant_bytes)
    quotas = dict(store._tenant_of.values())
    for tenant_name, used in tenant_bytes.items():
        require(name, "a tenant stays within its quota", used <= quotas[tenant_name], tenant_name)
    require(name, "leases are bounded", len(store._leases) <= store.config.max_leases)
    require(name, "puts in flight are bounded", len(store._pending) <= store.config.max_pending_puts)
    require(name, "nothing is protected between puts", not store._protected)
