"""One retry policy for every client of the pool: how long to wait before trying again, how
the wait grows, and how many tries there are. Each caller names its policy as a module
constant (``FAILOVER_REDIRECT`` in ``kvpool/directory/link.py``, ...), so the numbers are
written once and read in one place.

- ``RetryPolicy`` (frozen): ``first_delay_ms``, doubling (``multiplier``) up to
  ``max_delay_ms``; ``max_attempts`` tries in all (0: no limit: the caller stops it, by a
  deadline or a stop event).
- ``Backoff``: one sequence of waits of a policy (``next_delay_s``), ``reset`` after a
  success; for loops that wait on their own stop event.
- ``retry_call``: call, and on an error the policy retries, wait and call again; the last
  error is raised when the tries run out. ``before_retry`` runs between (rediscover a
  leader, drop a dead connection).

Deterministic (no jitter): callers are few per process and their peers are on loopback or
a LAN; tests replace ``sleep``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    first_delay_ms: float = 100.0
    max_delay_ms: float = 5_000.0
    multiplier: float = 2.0
    max_attempts: int = 0  # tries in all, the first included; 0 = no limit

    def __post_init__(self) -> None:
        if self.first_delay_ms < 0 or self.max_delay_ms < self.first_delay_ms:
            raise ValueError("need 0 <= first_delay_ms <= max_delay_ms")
        if self.multiplier < 1.0 or self.max_attempts < 0:
            raise ValueError("need multiplier >= 1 and max_attempts >= 0")

    def backoff(self) -> Backoff:
        return Backoff(self)


class Backoff:
    """The waits of one retry sequence: first_delay, x multiplier, ..., capped at max_delay."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.retries = 0
        self._next_ms = policy.first_delay_ms

    @property
    def exhausted(self) -> bool:
        """True when the policy allows no further try (``max_attempts`` counts the first)."""
        limit = self.policy.max_attempts
        return limit > 0 and self.retries + 1 >= limit

    def next_delay_s(self) -> float:
        """The wait before the next try (and count it)."""
        delay_ms = self._next_ms
        self._next_ms = min(self.policy.max_delay_ms, delay_ms * self.policy.multiplier)
        self.retries += 1
        return delay_ms / 1000.0

    def reset(self) -> None:
        self.retries = 0
        self._next_ms = self.policy.first_delay_ms


def retry_call(
    call: Callable[[], T],
    policy: RetryPolicy,
    retry_on: Callable[[BaseException], bool],
    before_retry: Callable[[BaseException], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``call()``; an exception that ``retry_on`` accepts is retried while ``policy`` allows
    (after ``before_retry(exc)`` and the policy's wait); any other, or the last, is raised."""
    backoff = policy.backoff()
    while True:
        try:
            return call()
        except Exception as exc:
            if backoff.exhausted or not retry_on(exc):
                raise
            if before_retry is not None:
                before_retry(exc)
            delay_s = backoff.next_delay_s()
            if delay_s > 0:
                sleep(delay_s)
