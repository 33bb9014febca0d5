"""``group_by_namespace`` against the plain per-key grouping it speeds up."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.keys import BLOCK_KEY_BYTES, NAMESPACE_BYTES, group_by_namespace

NAMESPACES = [bytes([n]) * NAMESPACE_BYTES for n in range(3)]
HASHES = st.binary(min_size=BLOCK_KEY_BYTES - NAMESPACE_BYTES, max_size=BLOCK_KEY_BYTES - NAMESPACE_BYTES)


def plain(keys: list[bytes]) -> dict[bytes, list[bytes]]:
    out: dict[bytes, list[bytes]] = {}
    for key in keys:
        out.setdefault(key[:NAMESPACE_BYTES], []).append(key[NAMESPACE_BYTES:])
    return out


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.tuples(st.sampled_from(NAMESPACES), HASHES).map(lambda t: t[0] + t[1]), max_size=80),
    odd=st.lists(st.binary(min_size=NAMESPACE_BYTES, max_size=80), max_size=3),
)
def test_groups_as_the_per_key_loop(keys: list[bytes], odd: list[bytes]) -> None:
    """One namespace (the one-pass path), several, hashes ending in zero bytes, and keys of
    another length (which must not be cut as 32-byte rows) all group as the loop does."""
    assert group_by_namespace(keys) == plain(keys)
    many = (keys * 40)[:200]  # past GROUP_IN_NUMPY_MIN: the one-pass path
    assert group_by_namespace(many) == plain(many)
    assert group_by_namespace(iter(keys)) == plain(keys)
    mixed = keys + odd
    assert group_by_namespace(mixed) == plain(mixed)
    zero_tail = [NAMESPACES[0] + key[NAMESPACE_BYTES:-4] + bytes(4) for key in many]
    assert group_by_namespace(zero_tail) == plain(zero_tail)
