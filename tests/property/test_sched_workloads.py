"""Generated workloads: block ids are prefix-chained like the Mooncake trace's (a shared id
at position k implies the same ids before it), lengths match the block count, arrivals
are ordered, and a seed fixes the trace."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.scheduler.trace import TRACE_BLOCK_TOKENS
from kvpool.scheduler.workloads import generate, workload_spec


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(["agent", "docqa", "chat"]),
    st.integers(1, 80),
    st.integers(1, 6),
    st.integers(1, 12),
    st.integers(0, 5),
)
def test_generated_traces_are_prefix_chained(kind: str, n: int, prefixes: int, sessions: int, seed: int) -> None:
    spec = workload_spec(
        kind,
        requests=n,
        shared_prefixes=prefixes,
        concurrent_sessions=sessions,
        shared_prefix_tokens=(300, 3000),
        turn_tokens=(1, 1200),
        seed=seed,
    )
    trace = generate(spec)
    assert len(trace) == n
    first_at: dict[int, tuple[int, ...]] = {}  # id -> the ids before it, the first time it was seen
    last_ms = -1.0
    for r in trace:
        assert r.arrival_ms >= last_ms
        last_ms = r.arrival_ms
        assert len(r.block_ids) == -(-r.input_tokens // TRACE_BLOCK_TOKENS)
        for k, b in enumerate(r.block_ids):
            before = r.block_ids[:k]
            assert first_at.setdefault(b, before) == before
    assert generate(spec) == trace
