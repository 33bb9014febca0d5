"""The one retry policy (``kvpool/core/retry.py``): the waits, the number of tries, what is
retried and what is not."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.core.errors import NotLeader, Unavailable
from kvpool.core.retry import Backoff, RetryPolicy, retry_call


@given(
    first=st.floats(0, 1000),
    extra=st.floats(0, 5000),
    multiplier=st.floats(1, 4),
    n=st.integers(1, 30),
)
def test_waits_grow_by_the_multiplier_up_to_the_cap_and_reset(
    first: float, extra: float, multiplier: float, n: int
) -> None:
    policy = RetryPolicy(first, first + extra, multiplier)
    backoff = Backoff(policy)
    waits = [backoff.next_delay_s() * 1000 for _ in range(n)]
    expected, want = [], first
    for _ in range(n):
        expected.append(want)
        want = min(first + extra, want * multiplier)
    assert waits == pytest.approx(expected)
    assert max(waits) <= first + extra + 1e-9 and backoff.retries == n
    backoff.reset()
    assert backoff.retries == 0 and backoff.next_delay_s() * 1000 == pytest.approx(first)


def test_retry_call_tries_max_attempts_then_raises_the_last_error() -> None:
    calls: list[int] = []
    slept: list[float] = []
    hooks: list[str] = []

    def failing() -> int:
        calls.append(len(calls))
        raise Unavailable(f"try {len(calls)}")

    policy = RetryPolicy(first_delay_ms=10, max_delay_ms=15, max_attempts=3)
    with pytest.raises(Unavailable, match="try 3"):
        retry_call(failing, policy, lambda e: isinstance(e, Unavailable), lambda e: hooks.append(str(e)), slept.append)
    assert len(calls) == 3 and slept == [0.010, 0.015] and len(hooks) == 2


def test_an_error_the_policy_does_not_retry_is_raised_at_once() -> None:
    calls: list[int] = []

    def refused() -> int:
        calls.append(1)
        raise NotLeader("standby")

    with pytest.raises(NotLeader):
        retry_call(refused, RetryPolicy(max_attempts=5), lambda e: isinstance(e, Unavailable), sleep=lambda s: None)
    assert calls == [1]


def test_a_success_after_a_retry_returns_its_value() -> None:
    answers = iter([Unavailable("down"), 7])

    def flaky() -> int:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert retry_call(flaky, RetryPolicy(0, 0, max_attempts=2), lambda e: True, sleep=lambda s: None) == 7


@pytest.mark.parametrize(
    "kwargs",
    [{"first_delay_ms": -1}, {"first_delay_ms": 10, "max_delay_ms": 5}, {"multiplier": 0.5}, {"max_attempts": -1}],
)
def test_a_policy_that_makes_no_sense_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
