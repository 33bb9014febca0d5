"""Where each block lives: a hash -> member-bitmask index plus bounded LRU caches.

Why a bitmask: a routing decision needs the longest cached prefix on *every*
instance. With one dict entry per block holding an int whose bit ``i`` says
"member i holds it", one walk over the request's hashes gives all the prefix
lengths at once (a member drops out at the first block whose bit is clear), so the
cost is O(blocks + members), not O(blocks * members).

Members are instances (prefill, decode, remote prefill) and the global pool; the
caller picks the bit numbers. ``LruCache`` is the capacity-limited store of one
member (an HBM tier that demotes into a DRAM tier, or the pool); it keeps the index
in step on insert and evict.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from kvpool.core.errors import InvalidArgument


class LocationIndex:
    """hash -> bitmask of members holding it."""

    def __init__(self, num_members: int) -> None:
        if num_members <= 0:
            raise InvalidArgument("an index needs at least one member")
        self.num_members = num_members
        self._loc: dict[bytes, int] = {}
        self.all_mask = (1 << num_members) - 1

    def __len__(self) -> int:
        return len(self._loc)

    def add(self, h: bytes, member: int) -> None:
        self._loc[h] = self._loc.get(h, 0) | (1 << member)

    def add_many(self, hashes: Iterable[bytes], member: int) -> None:
        bit = 1 << member
        loc = self._loc
        for h in hashes:
            loc[h] = loc.get(h, 0) | bit

    def remove(self, h: bytes, member: int) -> None:
        m = self._loc.get(h, 0) & ~(1 << member)
        if m:
            self._loc[h] = m
        else:
            self._loc.pop(h, None)

    def clear_member(self, member: int) -> None:
        """Drop every block of one member (a node restarted or lost its cache)."""
        keep = ~(1 << member)
        loc = self._loc
        for h in list(loc):
            m = loc[h] & keep
            if m:
                loc[h] = m
            else:
                del loc[h]

    def items(self) -> list[tuple[bytes, int]]:
        """(hash, member mask) for every indexed block (a snapshot, for consistency checks)."""
        return list(self._loc.items())

    def mask(self, h: bytes) -> int:
        return self._loc.get(h, 0)

    def holds(self, h: bytes, member: int) -> bool:
        return bool(self._loc.get(h, 0) >> member & 1)

    def prefix_lengths(self, hashes: Sequence[bytes], members_mask: int | None = None) -> tuple[np.ndarray, int]:
        """(longest cached prefix in blocks per member, longest prefix held by *any* member).

        Only members in ``members_mask`` are tracked (the others report 0 except
        through the union length).
        """
        n = len(hashes)
        out = np.zeros(self.num_members, dtype=np.int64)
        if not n:
            return out, 0
        loc = self._loc
        # the first block: the members that lack it keep the default 0, so only the holders
        # are tracked from here on (a 64-instance cluster usually holds a block on a few)
        first = loc.get(hashes[0], 0)
        alive = first if members_mask is None else first & members_mask
        if not alive:
            return out, self._union(hashes) if first else 0
        for i in range(1, n):
            m = loc.get(hashes[i], 0)
            if not m:
                _set_bits(out, alive, i)
                return out, i
            dropped = alive & ~m
            if dropped:
                _set_bits(out, dropped, i)
                alive &= m
                if not alive:
                    return out, self._union(hashes, i + 1)
        _set_bits(out, alive, n)
        return out, n

    def prefix_lengths_into(self, hashes: Sequence[bytes], out: np.ndarray) -> int:
        """``prefix_lengths(hashes)[0]`` written into ``out`` (all zeros on entry, ``num_members``
        long), without allocating or walking past the last holder; returns the mask of the
        members it may have written, for ``reset_lengths`` to zero them again afterwards."""
        n = len(hashes)
        if not n:
            return 0
        loc = self._loc
        first = alive = loc.get(hashes[0], 0)
        if not alive:
            return 0
        for i in range(1, n):
            m = loc.get(hashes[i], 0)
            dropped = alive & ~m
            if dropped:
                _set_bits(out, dropped, i)
                alive &= m
                if not alive:
                    return first
        _set_bits(out, alive, n)
        return first

    @staticmethod
    def reset_lengths(out: np.ndarray, written: int) -> None:
        """Zero the entries ``prefix_lengths_into`` wrote (``written`` is what it returned)."""
        if written:
            _set_bits(out, written, 0)

    def _union(self, hashes: Sequence[bytes], start: int = 1) -> int:
        """Longest prefix held by any member, given that its first ``start`` blocks are."""
        loc = self._loc
        for i in range(start, len(hashes)):
            if not loc.get(hashes[i], 0):
                return i
        return len(hashes)


def _set_bits(out: np.ndarray, mask: int, value: int) -> None:
    """out[i] = value for every set bit i of mask: a bit loop for a few bits, numpy for many
    (a request unknown to a 64-instance cluster drops all of them at block 0)."""
    if mask.bit_count() <= 6:
        while mask:
            low = mask & -mask
            out[low.bit_length() - 1] = value
            mask ^= low
        return
    n = out.shape[0]
    raw = np.frombuffer(mask.to_bytes((n + 7) // 8, "little"), dtype=np.uint8)
    out[np.unpackbits(raw, bitorder="little")[:n].view(bool)] = value


class LruCache:
    """A bounded LRU over block hashes (capacity in blocks; None = unbounded).

    ``demote_to`` chains a lower tier (HBM -> DRAM): a block evicted here moves there
    instead of leaving the member. ``on_leave(h)`` runs when a block leaves the
    member entirely, so the index can clear its bit.
    """

    def __init__(
        self,
        capacity_blocks: int | None,
        *,
        demote_to: LruCache | PolicyCache | None = None,
        on_leave: Callable[[bytes], None] | None = None,
    ) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise InvalidArgument(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._d: OrderedDict[bytes, None] = OrderedDict()
        self.demote_to = demote_to
        self.on_leave = on_leave
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, h: object) -> bool:
        return h in self._d

    def touch(self, h: bytes) -> bool:
        """Mark ``h`` recently used; False if absent."""
        d = self._d
        if h in d:
            d.move_to_end(h)
            return True
        return False

    def insert(self, h: bytes) -> None:
        """Insert or refresh ``h``, evicting (or demoting) the least recently used beyond capacity."""
        cap = self.capacity_blocks
        if cap == 0:
            self._leave(h)
            return
        d = self._d
        if h in d:
            d.move_to_end(h)
            return
        lower = self.demote_to
        if lower is not None and h in lower:
            lower.discard(h)  # promote: the block moves up, it does not leave the member
        d[h] = None
        if cap is not None and len(d) > cap:
            old, _ = d.popitem(last=False)
            self.evictions += 1
            self._leave(old)

    def _leave(self, h: bytes) -> None:
        if self.demote_to is not None:
            self.demote_to.insert(h)
        elif self.on_leave is not None:
            self.on_leave(h)

    def keys(self) -> list[bytes]:
        return list(self._d)

    def recency(self) -> OrderedDict[bytes, None]:
        """The LRU order itself (oldest first), for a caller's fast refresh path: moving a present
        key to the end is exactly ``insert`` of a present key."""
        return self._d

    def discard(self, h: bytes) -> None:
        """Forget ``h`` without calling ``on_leave`` (it moved to another tier of the same member)."""
        self._d.pop(h, None)


class PolicyCache:
    """A bounded cache ordered by one of storage's eviction policies (S3-FIFO, ARC, ...).

    Same surface as ``LruCache`` (insert / touch / contains), so the simulator can
    replay the trace under the policy the pool daemon will run. Every block is
    evictable here: the simulator has no leases or pins.
    """

    def __init__(
        self, capacity_blocks: int | None, policy: str, on_leave: Callable[[bytes], None] | None = None
    ) -> None:
        from kvpool.storage.eviction import make_policy

        if capacity_blocks is not None and capacity_blocks < 0:
            raise InvalidArgument(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.policy = make_policy(policy)
        self.on_leave = on_leave
        self._keys: set[bytes] = set()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, h: object) -> bool:
        return h in self._keys

    def touch(self, h: bytes) -> bool:
        if h in self._keys:
            self.policy.on_access(h)
            return True
        return False

    def insert(self, h: bytes) -> None:
        cap = self.capacity_blocks
        if cap == 0:
            if self.on_leave is not None:
                self.on_leave(h)
            return
        if h in self._keys:
            self.policy.on_access(h)
            return
        self._keys.add(h)
        self.policy.on_insert(h)
        while cap is not None and len(self._keys) > cap:
            victim = self.policy.pop_victim(lambda k: True)
            if victim is None:
                break
            self._keys.discard(victim)
            self.evictions += 1
            if self.on_leave is not None:
                self.on_leave(victim)

    def keys(self) -> list[bytes]:
        return list(self._keys)

    def discard(self, h: bytes) -> None:
        """Forget ``h`` without calling ``on_leave`` (it moved to another tier of the same member)."""
        if h in self._keys:
            self._keys.discard(h)
            self.policy.on_remove(h)


def make_cache(
    capacity_blocks: int | None, eviction: str, on_leave: Callable[[bytes], None] | None = None
) -> LruCache | PolicyCache:
    """LRU (the fast path) or one of ``kvpool.storage.eviction``'s policies."""
    if eviction == "lru":
        return LruCache(capacity_blocks, on_leave=on_leave)
    return PolicyCache(capacity_blocks, eviction, on_leave)


class TieredCache:
    """One instance's local cache: an HBM LRU that demotes into a DRAM tier (LRU or ``eviction``)."""

    def __init__(
        self,
        hbm_blocks: int | None,
        dram_blocks: int | None,
        on_leave: Callable[[bytes], None],
        eviction: str = "lru",
    ) -> None:
        self.dram = make_cache(dram_blocks, eviction, on_leave=on_leave)
        self.hbm = LruCache(hbm_blocks, demote_to=self.dram)

    def __contains__(self, h: object) -> bool:
        return h in self.hbm or h in self.dram

    def insert(self, h: bytes) -> None:
        self.hbm.insert(h)

    def __len__(self) -> int:
        return len(self.hbm) + len(self.dram)

    def keys(self) -> list[bytes]:
        return self.hbm.keys() + self.dram.keys()

    def dram_only(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes`` sit only in DRAM (they cost a PCIe copy up to HBM)."""
        hbm = self.hbm
        return sum(1 for h in hashes if h not in hbm)
