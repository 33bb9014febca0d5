"""The directory's read leases (``kvpool/directory/leases.py``): bounded, exact counts, and
the removes they defer; against a plain model in a hypothesis state machine."""

from __future__ import annotations

import json
import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.core.clock import FakeClock
from kvpool.core.hashing import HASH_SCHEME, block_hashes
from kvpool.core.spec import KVSpec, Namespace
from kvpool.directory.leases import LeaseTable
from kvpool.directory.state import DirectoryState, NodeRecord

SPEC = KVSpec(model="tiny", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=4)
NS = Namespace(SPEC, b"leases")
NS_ROW = (NS.digest(), SPEC.digest(), json.dumps(SPEC.to_dict()))
KEYS = block_hashes(NS, list(range(4 * 8)))


def test_a_full_table_answers_without_a_lease_and_counts_it() -> None:
    clock = FakeClock()
    s = DirectoryState(clock, node_ttl_ms=10_000, max_leases=2)
    s.register(NodeRecord("a", "a:1", "a:2", "tcp", "h", 1 << 30), HASH_SCHEME, [NS_ROW], KEYS[:4], b"")
    first = s.lookup(KEYS[:4], lease_ms=1000)
    second = s.lookup(KEYS[:2], lease_ms=5000)
    third = s.lookup(KEYS[:4], lease_ms=1000)
    assert (first.hits, second.hits, third.hits) == (4, 2, 4)
    assert first.lease_id > 0 and second.lease_id > 0 and third.lease_id == 0
    summary = s.summary()
    assert summary["leases_active"] == 2 and summary["leases_refused"] == 1
    clock.advance(1000)  # the first expires: room again, without waiting for the sweeper
    assert s.lookup(KEYS[:1], lease_ms=1000).lease_id > 0
    assert s.summary()["leases_active"] == 2


def test_a_remove_waits_for_the_last_lease_on_its_block() -> None:
    s = DirectoryState(FakeClock(), node_ttl_ms=10_000)
    s.register(NodeRecord("a", "a:1", "a:2", "tcp", "h", 1 << 30), HASH_SCHEME, [NS_ROW], KEYS[:3], b"")
    one = s.lookup(KEYS[:3], lease_ms=1000).lease_id
    two = s.lookup(KEYS[:1], lease_ms=1000).lease_id
    now, deferred = s.remove(KEYS[:2], NS.digest())
    assert now == {} and deferred == 2
    assert s.release([one]) == 1
    assert s.take_due_removes() == {NS.digest(): {"a": [KEYS[1]]}}
    assert s.release([two, two]) == 1
    assert s.take_due_removes() == {NS.digest(): {"a": [KEYS[0]]}}
    assert s.take_due_removes() == {}
    assert s.lookup(KEYS[:3]).hits == 0  # both gone from the index


class LeaseModel(RuleBasedStateMachine):
    MAX = 3

    def __init__(self) -> None:
        super().__init__()
        self.now_ms = 0.0
        seeded = random.Random(0)  # lease ids are random: seeded, so an example replays exactly
        self.table = LeaseTable(max_lease_ms=500, max_leases=self.MAX, random_id=lambda: seeded.getrandbits(63))
        self.model: dict[int, tuple[float, frozenset[bytes]]] = {}
        self.refused = 0

    def _expire_model(self) -> None:
        self.model = {i: v for i, v in self.model.items() if v[0] > self.now_ms}

    @rule(keys=st.lists(st.sampled_from(KEYS[:4]), min_size=1, max_size=4), lease_ms=st.integers(1, 2000))
    def grant(self, keys: list[bytes], lease_ms: int) -> None:
        lease_id = self.table.grant(keys, lease_ms, self.now_ms)
        if len(self.model) >= self.MAX:
            self._expire_model()
        if len(self.model) >= self.MAX:
            assert lease_id == 0
            self.refused += 1
        else:
            assert lease_id > 0 and lease_id not in self.model
            self.model[lease_id] = (self.now_ms + min(lease_ms, 500), frozenset(keys))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        ids = [*sorted(self.model), 10_000]
        lease_id = data.draw(st.sampled_from(ids))
        assert self.table.release([lease_id]) == (1 if lease_id in self.model else 0)
        self.model.pop(lease_id, None)

    @rule(ms=st.integers(0, 700))
    def advance(self, ms: int) -> None:
        self.now_ms += ms

    @rule()
    def expire(self) -> None:
        before = len(self.model)
        self._expire_model()
        assert self.table.expire(self.now_ms) == before - len(self.model)

    @invariant()
    def agrees(self) -> None:
        assert len(self.table) == len(self.model) <= self.MAX
        assert self.table.refused == self.refused
        for key in KEYS[:4]:
            assert self.table.is_leased(key) == any(key in keys for _, keys in self.model.values())


TestLeaseModel = LeaseModel.TestCase
TestLeaseModel.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
