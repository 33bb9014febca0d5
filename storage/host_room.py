"""How the host store makes room for a put: under its namespace's or tenant's quota
(``make_quota_room``), and in an owner's segments (``HostStore._allocate``): whether any
choice of evictions can give it the slots (checked before anything is evicted, so a put that
must fail costs no stored block), and emptying one whole segment of another owner when it
has nothing of its own to evict (per-tenant arenas, docs/security.md). Kept
beside the store (it reads the store's private state) so the store's own module stays
about its operations; called with the store's lock held."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.core.errors import CapacityExhausted
from kvpool.storage.allocator import NO_OWNER, slot_size_for

if TYPE_CHECKING:
    from kvpool.storage.host_store import HostStore


def evict_segment(store: HostStore, owner: int) -> bool:
    """Empty one segment of another owner whose blocks can all be evicted (the one with
    the fewest), so that it goes back to the free segments; False if there is none. A
    scan of the index, only when ``owner`` has no room and nothing of its own to evict."""
    blocks: dict[int, list[bytes]] = {}
    stuck: set[int] = set()
    for key, entry in store._index.items():
        seg = store._alloc.segment_of(entry.offset)
        if store._evictable(key):
            blocks.setdefault(seg, []).append(key)
        else:
            stuck.add(seg)
    candidates = [
        seg
        for seg, keys in blocks.items()
        if seg not in stuck
        and store._alloc.segment_owner(seg) not in (owner, NO_OWNER)
        and _segment_only_holds(store, seg, len(keys))
    ]
    if not candidates:
        return False
    victim = min(candidates, key=lambda seg: len(blocks[seg]))
    for key in blocks[victim]:
        store._policy.on_remove(key)
        store._evict_entry(store._index[key])
    return True


def _segment_only_holds(store: HostStore, seg: int, blocks: int) -> bool:
    """Whether the segment's used slots are exactly ``blocks`` indexed blocks (no pending
    put or leased, removed block holds a slot in it)."""
    first = seg * store._alloc.slabs_per_segment
    slabs = range(first, first + store._alloc.segment_slabs(seg))
    return sum(store._alloc.slab_used_slots(slab) for slab in slabs) == blocks


def check_can_fit(store: HostStore, count: int, block_bytes: int, owner: int = 0) -> None:
    """Raise CapacityExhausted, before anything is evicted, if no choice of evictions can
    yield ``count`` slots of this size for ``owner``: a put that must fail costs no stored
    block.

    Counted per slab, because slabs are per size class: evicting a block frees a slot of
    its own class, and frees room for another class only when its whole slab empties; a
    slab of another owner helps only when its whole segment empties.
    Free slots enough: nothing to check. Otherwise a scan of the index (in a full pool, every
    put): it stops as soon as enough evictable blocks of this size and owner are seen (each
    frees a usable slot), so a put in a full pool of a million blocks looks at about as many
    blocks as it must evict, not at all of them.
    """
    slot_bytes = slot_size_for(block_bytes)
    alloc = store._alloc
    free_now = alloc.free_slots_for(block_bytes, owner)
    if free_now >= count:
        return
    same_class = 0  # evictable blocks in this owner's slabs of this size class
    evictable_per_slab: dict[int, int] = {}
    usable: dict[int, bool] = {}  # slab -> of this size class and owner (asked once a slab)
    slab_bytes, evictable = alloc.slab_bytes, store._evictable
    for key, entry in store._index.items():
        if evictable(key):
            slab = entry.offset // slab_bytes
            evictable_per_slab[slab] = evictable_per_slab.get(slab, 0) + 1
            mine = usable.get(slab)
            if mine is None:
                offset = slab * slab_bytes
                mine = usable[slab] = (
                    alloc.slot_bytes_at(offset) == slot_bytes and alloc.segment_owner(alloc.segment_of(offset)) == owner
                )
            if mine:
                same_class += 1
                if free_now + same_class >= count:
                    return
    obtainable = free_now
    per_slab = store._alloc.slots_per_slab(block_bytes)
    others: dict[int, bool] = {}  # another owner's segment -> whether all of it can be evicted
    for slab, evictable in evictable_per_slab.items():
        seg = store._alloc.segment_of(slab * store._alloc.slab_bytes)
        whole = evictable == store._alloc.slab_used_slots(slab)
        if store._alloc.segment_owner(seg) != owner:
            others[seg] = others.get(seg, True) and whole
        elif store._alloc.slot_bytes_at(slab * store._alloc.slab_bytes) == slot_bytes:
            obtainable += evictable  # same class: each eviction frees a usable slot
        elif whole:
            obtainable += per_slab  # another class: only a slab emptied whole helps
    for seg, whole in others.items():  # emptied whole, another owner's segment is free for anyone
        evictable_slabs = sum(1 for slab in evictable_per_slab if slab // store._alloc.slabs_per_segment == seg)
        if whole and evictable_slabs == store._alloc.segment_slabs_used(seg):
            obtainable += store._alloc.segment_slabs(seg) * per_slab
    if obtainable < count:
        raise CapacityExhausted(
            f"no room for {count} blocks of {block_bytes} bytes: {store._alloc.used_bytes} of "
            f"{store._alloc.capacity_bytes} bytes are used and evictions could free only {obtainable} "
            "such slots (the rest is leased, pinned or in flight); nothing was evicted",
            hint="raise --capacity-bytes, release leases and pins, or put fewer blocks at once",
        )


def make_quota_room(store: HostStore, namespace: bytes, need: int) -> None:
    """Evict blocks of ``namespace``, or of every namespace of its tenant where the tenant
    has its own quota, until ``need`` more bytes fit that quota; raise CapacityExhausted
    before evicting anything if they cannot. The put's caller has checked the arena's room
    first (``check_can_fit``): the evictions here must not be for a put that then fails."""
    tenant = store._tenant_of.get(namespace)
    if tenant is not None:
        name, quota = tenant
        used, whose = store._tenant_bytes.get(name, 0), f"tenant {name!r}"
        tenant_of = store._tenant_of

        def member(ns: bytes) -> bool:
            owner = tenant_of.get(ns)
            return owner is not None and owner[0] == name
    else:
        quota, used = store.config.namespace_quota_bytes, store._ns_bytes.get(namespace, 0)
        whose = f"namespace {namespace.hex()[:32]}"

        def member(ns: bytes) -> bool:
            return ns == namespace

    over = used + need - quota
    if quota == 0 or over <= 0:
        return
    evictable = 0  # counted until it covers ``over``: a tenant at its quota puts this way every time
    if need <= quota:
        for key, entry in store._index.items():
            if member(entry.namespace) and store._evictable(key):
                evictable += entry.size
                if evictable >= over:
                    break
    if need > quota or evictable < over:
        raise CapacityExhausted(
            f"{whose} holds {used} bytes; {need} more would pass its quota of {quota} bytes and only "
            f"{evictable} of its bytes can be evicted (the rest is leased, pinned or being written); "
            "nothing was evicted",
            hint="release leases and pins, put fewer blocks at once, or raise the quota "
            "(--namespace-quota-bytes, or the tenant's quota_bytes in the credentials file)",
        )
    while store._quota_used(namespace) + need > quota and store._evict_one(member):
        pass
