"""What a node counts about the blocks its clients ask for: lookups and reads, in blocks and
tokens, node-wide, per tier and per namespace (docs/architecture.md "Counters").

Two questions, two counters, so that neither is counted twice:
- **Lookup** ("how much of this prompt is cached?"): each ``Lookup`` call counts its leading
  run of present blocks as hit (per tier: the fastest tier holding each) and every other
  block it named as missed, including blocks after the first miss (a prefix cache cannot
  use them: the engine recomputes from the first miss on). The hit rate is
  ``lookup_hit_blocks / (lookup_hit_blocks + lookup_missed_blocks)``: the share of the
  looked-up full blocks (and so of their tokens) that need no prefill.
- **Read** (``Lease``, from a same-host client or a peer over the data plane): each call
  counts the blocks it leased as hit and the rest it named as missed. Two reads of one
  block are two reads. Reads do not enter the hit rate: an engine that looks up and then
  reads the same blocks asked one question, not two.

Tokens are blocks x the namespace's ``block_tokens``. Per-namespace counters live as long
as the namespace is registered (the node's table is bounded, so they are too) and are
dropped when it is retired; node-wide ones live as long as the daemon.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

#: the tiers a lookup hit can be counted in (in the read order of the tiered store)
TIERS = ("host", "device", "disk")


@dataclass
class _Counts:
    lookup_calls: int = 0
    lookup_hit_blocks: int = 0
    lookup_missed_blocks: int = 0
    lookup_hit_tokens: int = 0
    lookup_missed_tokens: int = 0
    lookup_hit_blocks_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    lookup_hit_tokens_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    read_calls: int = 0
    read_hit_blocks: int = 0
    read_missed_blocks: int = 0
    read_hit_tokens: int = 0
    read_missed_tokens: int = 0

    def add_lookup(self, hit_blocks_by_tier: dict[str, int], missed_blocks: int, block_tokens: int) -> None:
        self.lookup_calls += 1
        for tier, blocks in hit_blocks_by_tier.items():
            self.lookup_hit_blocks += blocks
            self.lookup_hit_tokens += blocks * block_tokens
            self.lookup_hit_blocks_by_tier[tier] = self.lookup_hit_blocks_by_tier.get(tier, 0) + blocks
            self.lookup_hit_tokens_by_tier[tier] = self.lookup_hit_tokens_by_tier.get(tier, 0) + blocks * block_tokens
        self.lookup_missed_blocks += missed_blocks
        self.lookup_missed_tokens += missed_blocks * block_tokens

    def add_read(self, hit_blocks: int, missed_blocks: int, block_tokens: int) -> None:
        self.read_calls += 1
        self.read_hit_blocks += hit_blocks
        self.read_missed_blocks += missed_blocks
        self.read_hit_tokens += hit_blocks * block_tokens
        self.read_missed_tokens += missed_blocks * block_tokens

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "lookup_calls": self.lookup_calls,
            "lookup_hit_blocks": self.lookup_hit_blocks,
            "lookup_missed_blocks": self.lookup_missed_blocks,
            "lookup_hit_tokens": self.lookup_hit_tokens,
            "lookup_missed_tokens": self.lookup_missed_tokens,
            "lookup_hit_blocks_by_tier": dict(self.lookup_hit_blocks_by_tier),
            "lookup_hit_tokens_by_tier": dict(self.lookup_hit_tokens_by_tier),
            "read_calls": self.read_calls,
            "read_hit_blocks": self.read_hit_blocks,
            "read_missed_blocks": self.read_missed_blocks,
            "read_hit_tokens": self.read_hit_tokens,
            "read_missed_tokens": self.read_missed_tokens,
        }
        looked_up = self.lookup_hit_blocks + self.lookup_missed_blocks
        # None (JSON null) until something was looked up: "no lookups" is not a 100% hit rate
        out["lookup_hit_rate"] = self.lookup_hit_blocks / looked_up if looked_up else None
        return out


class TrafficCounters:
    """Lookup and read counters of one node. Thread-safe (one lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = _Counts()
        self._by_namespace: dict[bytes, _Counts] = {}

    def count_lookup(
        self, namespace: bytes, block_tokens: int, hit_blocks_by_tier: dict[str, int], asked_blocks: int
    ) -> None:
        """One Lookup of ``asked_blocks`` blocks whose leading run was found, per tier."""
        missed = asked_blocks - sum(hit_blocks_by_tier.values())
        with self._lock:
            for counts in (self._total, self._namespace(namespace)):
                counts.add_lookup(hit_blocks_by_tier, missed, block_tokens)

    def count_read(self, namespace: bytes, block_tokens: int, hit_blocks: int, asked_blocks: int) -> None:
        """One read (a lease) of ``asked_blocks`` blocks of which ``hit_blocks`` were served."""
        with self._lock:
            for counts in (self._total, self._namespace(namespace)):
                counts.add_read(hit_blocks, asked_blocks - hit_blocks, block_tokens)

    def forget(self, namespace: bytes) -> None:
        """A retired namespace's counters go with it (the node-wide ones keep its counts)."""
        with self._lock:
            self._by_namespace.pop(namespace, None)

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return self._total.as_dict()

    def namespace_summary(self, namespace: bytes) -> dict[str, Any]:
        with self._lock:
            counts = self._by_namespace.get(namespace)
            return (counts if counts is not None else _Counts()).as_dict()

    def _namespace(self, namespace: bytes) -> _Counts:
        counts = self._by_namespace.get(namespace)
        if counts is None:
            counts = self._by_namespace[namespace] = _Counts()
        return counts
