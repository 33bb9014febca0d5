"""Debug mode: every stateful structure checks its own invariants after each operation.

TigerBeetle-style: each structure (``HostStore``, ``TieredStore``'s block records,
``SlabAllocator``, the disk tier's state, the directory's index and leases) has a
``check_invariants()`` that walks its state and raises ``InvariantViolated`` naming the
invariant that does not hold. The mutating operations are decorated with
``checked_after``, the one place per operation where the check is called.

Off by default: a check walks the whole structure (O(blocks)), which no production node
should pay per call; off, the cost is one attribute test per operation. The test suite
turns it on (``tests/conftest.py``: in-process with ``set_enabled(True)``, in the daemons
it starts with ``KVPOOL_DEBUG_INVARIANTS=1``, which only the composition root reads:
``kvpool.cli.main``). A violation is a bug in kvpool, never a user error, so it is
``ErrorCode.INTERNAL`` and says which structure and which invariant.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from kvpool.core.errors import ErrorCode, KVPoolError

#: the environment variable the composition root reads to turn debug mode on ("1")
ENV_VAR = "KVPOOL_DEBUG_INVARIANTS"


class InvariantViolated(KVPoolError):
    """A structure's state broke one of its own rules: a bug, reported with its name."""

    code = ErrorCode.INTERNAL

    def __init__(self, structure: str, invariant: str, detail: str = "") -> None:
        self.structure = structure
        self.invariant = invariant
        text = f"{structure}: invariant '{invariant}' does not hold"
        super().__init__(
            f"{text}: {detail}" if detail else text,
            hint="a kvpool bug: report it with this message (debug invariants are on)",
        )


class _Switch:
    """The process-wide switch (set once by the composition root or the test harness)."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


DEBUG = _Switch()


def set_enabled(on: bool) -> None:
    DEBUG.on = on


def enabled() -> bool:
    return DEBUG.on


def enable_from_environ(environ: Any) -> None:
    """Turn debug mode on when ``environ[ENV_VAR]`` is "1" (called by ``kvpool.cli.main``)."""
    if environ.get(ENV_VAR, "") == "1":
        set_enabled(True)


def require(structure: str, invariant: str, holds: bool, detail: Callable[[], str] | str = "") -> None:
    """Raise ``InvariantViolated`` unless ``holds``; ``detail`` may be a callable so the
    message is only built when the check fails."""
    if not holds:
        raise InvariantViolated(structure, invariant, detail() if callable(detail) else detail)


class Checked(Protocol):
    def check_invariants(self) -> None: ...


M = TypeVar("M", bound=Callable[..., Any])


def checked_after(method: M) -> M:
    """Run ``self.check_invariants()`` after ``method`` returns, when debug mode is on."""

    @functools.wraps(method)
    def wrapper(self: Checked, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if DEBUG.on:
            self.check_invariants()
        return result

    return wrapper  # type: ignore[return-value]
