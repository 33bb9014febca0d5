"""Every eviction policy, under random operation sequences: a victim is always a resident,
evictable key; None only when nothing resident is evictable; the policy's size tracks the
resident set."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.storage.eviction import POLICIES, make_policy

OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "access", "remove", "pop"]), st.integers(0, 30), st.integers(0, 2**31)),
    max_size=200,
)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_policy_victims_are_resident_and_evictable(name: str, ops: list[tuple[str, int, int]]) -> None:
    policy = make_policy(name)
    resident: set[bytes] = set()
    for op, i, mask in ops:
        key = i.to_bytes(2, "little")
        if op == "insert" and key not in resident:
            policy.on_insert(key)
            resident.add(key)
        elif op == "access" and key in resident:
            policy.on_access(key)
        elif op == "remove" and key in resident:
            policy.on_remove(key)
            resident.discard(key)
        elif op == "pop":

            def evictable(k: bytes, mask: int = mask) -> bool:
                return bool((mask >> (int.from_bytes(k, "little") % 31)) & 1)

            victim = policy.pop_victim(evictable)
            if victim is None:
                assert not any(evictable(k) for k in resident)
            else:
                assert victim in resident and evictable(victim)
                resident.discard(victim)
        assert len(policy) == len(resident)
