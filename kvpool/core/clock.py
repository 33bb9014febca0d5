"""Clocks are passed in, never read from a global, so tests can drive time by hand."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> float:
        """Monotonic milliseconds; only differences mean anything."""
        ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` in milliseconds."""

    def now_ms(self) -> float:
        return time.monotonic() * 1000.0


class FakeClock:
    """A clock that moves only when told to; thread-safe."""

    def __init__(self, start_ms: float = 0.0) -> None:
        self._now_ms = start_ms
        self._lock = threading.Lock()

    def now_ms(self) -> float:
        with self._lock:
            return self._now_ms

    def advance(self, delta_ms: float) -> None:
        if delta_ms < 0:
            raise ValueError("a clock never runs backwards")
        with self._lock:
            self._now_ms += delta_ms
