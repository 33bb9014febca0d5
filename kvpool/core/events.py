"""KV events: what a node stored, removed or cleared, in order.

Each node numbers its events 1, 2, 3, ... (``seq``). A subscriber that sees a gap
(``seq`` not previous + 1) has missed events and must resync from a snapshot.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"  # evicted, removed by a client, or dropped after a failed checksum
    CLEARED = "cleared"  # everything on the node is gone (restart without recovery, clear)


@dataclass(frozen=True)
class KVEvent:
    node_id: str
    seq: int
    kind: EventKind
    hashes: tuple[bytes, ...]  # 16-byte block hashes; empty for CLEARED
    tier: str = "host"
    namespace: bytes = b""  # 16-byte namespace digest ("" when mixed / unknown)
    parent_hash: bytes = b""  # the hash before hashes[0] in its chain, when known (vLLM format wants it)
    block_tokens: int = 0
