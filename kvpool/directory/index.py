"""The directory's index: which registered node holds which block, in which tier, and the
answer to a prompt's lookup (its leading held run, with a holder mask per block).

Not thread-safe on its own: ``DirectoryState`` calls it under its lock. Keys are opaque
block keys (the service's are ``namespace digest || hash``); nodes are named by a slot
number that stays the node's across re-registrations.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvpool.core.invariants import require

TIER_CODES = {"device": 2, "host": 0, "disk": 1}
TIER_NAMES = {code: name for name, code in TIER_CODES.items()}
#: lower is better for reading: host DRAM first, then device, then disk
TIER_RANK = {0: 0, 2: 1, 1: 2}
MAX_HOLDERS_IN_REPLY = 64
_NO_TIER = 3


@dataclass
class NodeRecord:
    node_id: str
    control_address: str
    data_address: str
    transport: str
    host: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    incarnation: int = 0
    last_seq: int = 0
    last_heartbeat_ms: float = 0.0
    last_registered_ms: float = 0.0
    alive: bool = True
    confirmed: bool = True  # False after a directory restart until the node heartbeats again
    # True when the loaded key list could not be read (an old or damaged row): its blocks are
    # not offered and its next heartbeat gets ``resync`` whatever its seq
    resync_needed: bool = False
    slot: int = 0
    keys: dict[bytes, int] = field(default_factory=dict)  # block key -> tier code
    # what readers need beyond data_address (a NIXL agent's metadata); not persisted: a restarted
    # directory serves "" until the node re-registers, and readers then ask the node itself
    transport_metadata: bytes = b""

    def public(self) -> dict[str, object]:
        return {
            "node_id": self.node_id,
            "control_address": self.control_address,
            "data_address": self.data_address,
            "transport": self.transport,
            "host": self.host,
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "incarnation": self.incarnation,
            "last_seq": self.last_seq,
        }

    @property
    def free_ratio(self) -> float:
        if self.capacity_bytes <= 0:
            return 0.0
        return max(0.0, 1.0 - self.used_bytes / self.capacity_bytes)


@dataclass(frozen=True)
class LeadingRun:
    """A lookup's answer before leases: the nodes named (bit i of a mask = ``nodes[i]``), one
    mask and best tier per hit block."""

    nodes: list[NodeRecord]
    masks: list[int]
    tiers: bytes

    @property
    def hits(self) -> int:
        return len(self.masks)


class BlockIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, dict[int, int]] = {}  # block key -> {node slot: tier code}
        self._by_slot: dict[int, NodeRecord] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def node_at(self, slot: int) -> NodeRecord | None:
        return self._by_slot.get(slot)

    def holds(self, key: bytes) -> bool:
        return key in self._holders

    def namespaces_in_use(self) -> set[bytes]:
        return {key[:16] for key in self._holders}

    # -- nodes and their blocks ---------------------------------------------------------------
    def attach(self, node: NodeRecord) -> None:
        """Index a node and the blocks in its ``keys``."""
        self._by_slot[node.slot] = node
        for key, tier in node.keys.items():
            self._holders.setdefault(key, {})[node.slot] = tier

    def detach(self, node: NodeRecord) -> None:
        self.drop_keys(node)
        self._by_slot.pop(node.slot, None)

    def add(self, node: NodeRecord, key: bytes, tier: int) -> None:
        node.keys[key] = tier
        self._holders.setdefault(key, {})[node.slot] = tier

    def discard(self, node: NodeRecord, key: bytes) -> None:
        if node.keys.pop(key, None) is None:
            return
        self._unhold(key, node.slot)

    def drop_keys(self, node: NodeRecord) -> None:
        for key in node.keys:
            self._unhold(key, node.slot)
        node.keys = {}

    def _unhold(self, key: bytes, slot: int) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.pop(slot, None)
            if not holders:
                del self._holders[key]

    def holders_by_node(self, keys: Iterable[bytes], forget: bool) -> dict[str, list[bytes]]:
        """The named blocks grouped by holder node id; ``forget`` drops them from the index."""
        out: dict[str, list[bytes]] = {}
        for key in keys:
            for slot in list(self._holders.get(key, {})):
                node = self._by_slot.get(slot)
                if node is None:
                    continue
                out.setdefault(node.node_id, []).append(key)
                if forget:
                    self.discard(node, key)
        return out

    def check_invariants(self) -> None:
        """The holder map is exactly the attached nodes' key lists (debug mode; called by
        ``DirectoryState`` under its lock): no key without a holder, no holder that is not
        an attached node holding the key in that tier."""
        name = "BlockIndex"
        held = 0
        for slot, node in self._by_slot.items():
            require(name, "a node is attached under its slot", node.slot == slot, node.node_id)
            for key, tier in node.keys.items():
                holders = self._holders.get(key)
                require(
                    name,
                    "every key of an attached node is in the holder map",
                    holders is not None and holders.get(slot) == tier,
                    key.hex,
                )
            held += len(node.keys)
        pairs = 0
        for key, holders in self._holders.items():
            require(name, "a held key has a holder", bool(holders), key.hex)
            for slot in holders:
                require(name, "a holder is an attached node", slot in self._by_slot, key.hex)
            pairs += len(holders)
        require(name, "holders are the nodes' keys", pairs == held, f"{pairs} holder entries, {held} node keys")

    # -- lookups ------------------------------------------------------------------------------
    def leading_run(self, keys: Sequence[bytes]) -> LeadingRun:
        """Per leading block, which live nodes hold it (stops at the first block nobody holds).

        The reply names at most ``MAX_HOLDERS_IN_REPLY`` nodes, and every block counted as a
        hit has at least one of them in its mask: a hit the client cannot read from is worse
        than a miss (it plans a read with no holder). The usual prompt has a few holders and
        takes one pass; one whose holders do not fit goes through ``reply_slots``.
        """
        cap = MAX_HOLDERS_IN_REPLY
        run: list[dict[int, int]] = []  # holders of each leading held block
        bit_of: dict[int, int] = {}
        masks: list[int] = []
        tiers = bytearray()
        overflow = False
        for key in keys:
            holders = self._holders.get(key)
            if not holders:
                break
            run.append(holders)
            if overflow:
                continue
            mask = 0
            best = _NO_TIER
            for slot, tier in holders.items():
                bit = bit_of.get(slot)
                if bit is None:
                    if len(bit_of) >= cap:
                        overflow = True  # redone below by reply_slots
                        break
                    bit = bit_of[slot] = len(bit_of)
                mask |= 1 << bit
                if TIER_RANK.get(tier, _NO_TIER) < TIER_RANK.get(best, _NO_TIER):
                    best = tier
            else:
                masks.append(mask)
                tiers.append(best if best != _NO_TIER else 0)
        if overflow:
            slots, hits = reply_slots(run, cap)
            bit_of = {slot: bit for bit, slot in enumerate(slots)}
            masks, tiers = [], bytearray()
            for holders in run[:hits]:
                _mask_block(holders, bit_of, masks, tiers)
        return LeadingRun([self._by_slot[slot] for slot in bit_of], masks, bytes(tiers))


def _mask_block(holders: dict[int, int], bit_of: dict[int, int], masks: list[int], tiers: bytearray) -> None:
    """Append one block's holder mask (over the reply's nodes) and the best tier among them."""
    mask = 0
    best = _NO_TIER
    for slot, tier in holders.items():
        bit = bit_of.get(slot)
        if bit is None:
            continue  # not in the reply: the client cannot read from it
        mask |= 1 << bit
        if TIER_RANK.get(tier, _NO_TIER) < TIER_RANK.get(best, _NO_TIER):
            best = tier
    masks.append(mask)
    tiers.append(best if best != _NO_TIER else 0)


def reply_slots(run: Sequence[dict[int, int]], cap: int) -> tuple[list[int], int]:
    """For a prompt whose holders do not all fit in a reply: the node slots to name (in bit
    order, at most ``cap``) and how many leading blocks of ``run`` they cover (the hits).

    Greedy cover: walking the blocks, a block none of the chosen nodes holds gets the holder
    whose contiguous run from there reaches furthest (the longest prefix any choice could
    cover when each node holds a contiguous run, which chain hashes make the usual case); the
    hits stop at the first block that would need a node past the cap. The spare room is then
    filled with further holders, earliest blocks first, so the client still has replicas to
    choose from.
    """
    chosen: dict[int, None] = {}  # insertion-ordered set
    hits = 0
    while hits < len(run):
        if not any(slot in chosen for slot in run[hits]):
            if len(chosen) >= cap:
                break
            # the holders whose contiguous run from here reaches furthest: lockstep scan
            furthest = set(run[hits])
            for holders in itertools.islice(run, hits + 1, None):
                still = furthest.intersection(holders)
                if not still:
                    break
                furthest = still
            chosen[min(furthest)] = None
        hits += 1
    for holders in run[:hits]:
        for slot in holders:
            if len(chosen) >= cap:
                return list(chosen), hits
            chosen.setdefault(slot)
    return list(chosen), hits
