"""The daemon's bounded block history (``kvpool.daemon.block_history``): the removal log keeps
the latest removals up to its capacity and forgets a block stored again; the hot counters stay
bounded and keep a block read often above one-off reads; the lease refusals keep each
namespace's latest refusal, bounded, until a lease is granted."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.daemon.block_history import MAX_REFUSAL_MESSAGE_CHARS, HotBlocks, LeaseRefusals, Removal, RemovalLog

KEYS = st.binary(min_size=2, max_size=2)
OPS = st.lists(st.tuples(st.sampled_from(["removed", "stored"]), st.lists(KEYS, max_size=4)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 8))
def test_removal_log_matches_a_model(ops: list[tuple[str, list[bytes]]], capacity: int) -> None:
    log = RemovalLog(capacity)
    model: list[tuple[bytes, int]] = []  # (key, at) in removal order, latest last
    for at, (kind, keys) in enumerate(ops):
        if kind == "removed":
            log.on_removed(keys, Removal("evicted", "host", "lru", float(at)))
            for key in keys:
                model = [(k, t) for k, t in model if k != key] + [(key, at)]
            model = model[-capacity:]
        else:
            log.on_stored(keys)
            model = [(k, t) for k, t in model if k not in keys]
        assert len(log) == len(model) <= capacity
    for key, at in model:
        record = log.get(key)
        assert record is not None and record.at_ms == float(at)


def test_a_block_stored_again_has_nothing_to_explain() -> None:
    log = RemovalLog(4)
    log.on_removed([b"a"], Removal("checksum_failure", "disk", "", 1.0))
    assert log.get(b"a") == Removal("checksum_failure", "disk", "", 1.0)
    log.on_stored([b"a"])
    assert log.get(b"a") is None


@settings(max_examples=100, deadline=None)
@given(reads=st.lists(st.lists(KEYS, min_size=1, max_size=6), max_size=80), capacity=st.integers(1, 16))
def test_hot_counts_stay_bounded(reads: list[list[bytes]], capacity: int) -> None:
    hot = HotBlocks(capacity)
    for keys in reads:
        hot.on_read(keys)
        assert len(hot.top_blocks(10_000)) <= capacity
        assert len(hot.top_prefixes(10_000)) <= capacity
    counts = [n for _, n in hot.top_blocks(10_000)]
    assert counts == sorted(counts, reverse=True) and all(n > 0 for n in counts)


def test_a_block_read_often_outlasts_one_off_reads() -> None:
    hot = HotBlocks(capacity=8)
    for i in range(200):
        hot.on_read([b"system-prompt", i.to_bytes(4, "little")])
    top = hot.top_blocks(1)
    assert top[0][0] == b"system-prompt" and top[0][1] > 1
    prefix, reads, longest = hot.top_prefixes(1)[0]
    assert prefix == b"system-prompt" and reads > 1 and longest == 2


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["refused", "granted"]), KEYS, st.sampled_from(["TENANT_BUSY", "X"])),
                 max_size=60),
    capacity=st.integers(1, 8),
)  # fmt: skip
def test_lease_refusals_match_a_model(ops: list[tuple[str, bytes, str]], capacity: int) -> None:
    refusals = LeaseRefusals(capacity)
    model: dict[bytes, tuple[str, float]] = {}  # insertion order = refusal order, latest last
    for at, (kind, namespace, code) in enumerate(ops):
        if kind == "refused":
            refusals.note(namespace, code, "m" * 500, float(at))
            model.pop(namespace, None)
            model[namespace] = (code, float(at))
            while len(model) > capacity:
                del model[next(iter(model))]
        else:
            refusals.on_granted(namespace)
            model.pop(namespace, None)
        assert len(refusals) == len(model) <= capacity
    for namespace, (code, at) in model.items():
        got = refusals.get(namespace)
        assert got is not None and (got.code, got.at_ms) == (code, at)
        assert len(got.message) == MAX_REFUSAL_MESSAGE_CHARS
