"""Debug mode: every stateful structure checks its own invariants after each operation.

TigerBeetle-style: each structure (``HostStore``, ``TieredStore``'s block records,
``SlabAllocator``, the disk tier's state, the directory's index and leases) has a
``check_invariants()`` that walks its state and raises ``InvariantViolated`` naming the
invariant that does not hold. The mutating operations are decorated with
``checked_after``, the one place per operation where the check is called.

Off by default: a check walks the whole structure (O(blocks)), which no production node
should pay per call. Off, it costs nothing: ``checked_after`` decides when the class is
defined, so the switch must be set before ``kvpool.storage`` / ``kvpool.directory`` are
imported (the composition root ``kvpool.cli.main`` reads ``KVPOOL_DEBUG_INVARIANTS=1``
before it imports any subcommand; ``tests/conftest.py`` sets it before its own imports, for
the stores and directories tests build in-process). Turned on later, it warns that the
operations already defined are not checked. Turned off later, the wrapped operations stop
checking. A violation is a bug in kvpool, never a user error, so it is
``ErrorCode.INTERNAL`` and says which structure and which invariant.
"""

from __future__ import annotations

import functools
import logging
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


log = logging.getLogger(__name__)


class _Switch:
    """The process-wide switch (set once by the composition root or the test harness);
    ``bare`` counts the operations defined while it was off (left without a check)."""

    __slots__ = ("bare", "on")

    def __init__(self) -> None:
        self.on = False
        self.bare = 0


DEBUG = _Switch()


def set_enabled(on: bool) -> None:
    if on and not DEBUG.on and DEBUG.bare:
        log.warning(
            "debug invariants turned on after %d operations were defined without checks: set %s=1 "
            "(or set_enabled) before importing kvpool.storage / kvpool.directory",
            DEBUG.bare,
            ENV_VAR,
        )
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
    """Run ``self.check_invariants()`` after ``method`` returns, when debug mode is on.
    With debug mode off when the class is defined, ``method`` is returned as it is."""
    if not DEBUG.on:
        DEBUG.bare += 1
        return method

    @functools.wraps(method)
    def wrapper(self: Checked, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if DEBUG.on:
            self.check_invariants()
        return result

    return wrapper  # type: ignore[return-value]
