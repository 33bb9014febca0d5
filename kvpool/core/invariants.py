"""Debug mode: every stateful structure checks its own invariants after each operation.

TigerBeetle-style: each structure (``HostStore``, ``TieredStore``'s block records,
``SlabAllocator``, the disk tier's state, the directory's index and leases) has a
``check_invariants()`` that walks its state and raises ``InvariantViolated`` naming the
invariant that does not hold. The mutating operations are decorated with
``checked_after``, the one place per operation where the check is called.

Off by default: a check walks the whole structure (O(blocks)), which no production node
should pay per call. Two modes: ``KVPOOL_DEBUG_INVARIANTS=1`` checks after every operation
(what the in-process tests use: a broken rule is caught by the operation that broke it);
``KVPOOL_DEBUG_INVARIANTS=sampled`` checks a structure after an operation only once the
time since its last check is at least ``1 / SAMPLED_SHARE`` times what that check took, so
checking costs at most about ``SAMPLED_SHARE`` of the time whatever the structure's size
(what the daemons started by the tests use: a rule that stays broken is still caught, by a
later operation, without making a 2,000-block test quadratic). Off, it costs nothing:
``checked_after`` decides when the class is defined, so the switch must be set before
``kvpool.storage`` / ``kvpool.directory`` are imported (the composition root
``kvpool.cli.main`` reads ``KVPOOL_DEBUG_INVARIANTS`` before it imports any subcommand;
``tests/conftest.py`` turns it on before its own imports, for the stores and directories
tests build in-process, and sets ``sampled`` in the environment of every process a test
starts). Turned on later, it warns that the
operations already defined are not checked. Turned off later, the wrapped operations stop
checking. A violation is a bug in kvpool, never a user error, so it is
``ErrorCode.INTERNAL`` and says which structure and which invariant.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from kvpool.core.errors import ErrorCode, KVPoolError

#: the environment variable the composition root reads to turn debug mode on
#: ("1": after every operation; "sampled": at a bounded share of the time)
ENV_VAR = "KVPOOL_DEBUG_INVARIANTS"
#: in sampled mode, the most of a structure's time its checks may take
SAMPLED_SHARE = 0.1
_SAMPLED_MAX_TRACKED = 4096  # structures whose next check time is remembered (a bound, not a goal)


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
    ``bare`` counts the operations defined while it was off (left without a check);
    ``sampled`` selects the bounded-share mode, ``next_check_s`` holds, per structure
    (by ``id``), the monotonic time before which sampled mode skips its check."""

    __slots__ = ("bare", "next_check_s", "on", "sampled")

    def __init__(self) -> None:
        self.on = False
        self.sampled = False
        self.bare = 0
        self.next_check_s: dict[int, float] = {}


DEBUG = _Switch()


def set_sampled(sampled: bool) -> None:
    """Sampled mode (see the module docstring) or, with False, a check after every operation."""
    DEBUG.sampled = sampled
    DEBUG.next_check_s.clear()


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


def describe() -> str:
    """How the checks run, for the daemons' start-up log line."""
    if not DEBUG.on:
        return "off"
    if DEBUG.sampled:
        return f"sampled (at most ~{SAMPLED_SHARE:.0%} of each structure's time)"
    return "after every operation"


def log_if_enabled(logger: logging.Logger) -> None:
    """One warning at a daemon's start when debug mode is on: it costs time and is meant
    for tests, so an operator who sees it in production knows to unset the variable."""
    if DEBUG.on:
        logger.warning("debug invariants on, %s (%s is set; unset it in production)", describe(), ENV_VAR)


def enable_from_environ(environ: Any) -> None:
    """Turn debug mode on when ``environ[ENV_VAR]`` is "1" (every operation) or "sampled"
    (called by ``kvpool.cli.main``). Already on after every operation (a test process that
    runs the CLI in-process), it stays so: sampled never weakens a harness's choice."""
    value = environ.get(ENV_VAR, "")
    if value not in ("1", "sampled"):
        return
    if not DEBUG.on:
        set_sampled(value == "sampled")
    set_enabled(True)


def _sampled_check(self: Checked) -> None:
    key = id(self)
    now_s = time.monotonic()
    if now_s < DEBUG.next_check_s.get(key, 0.0):
        return
    self.check_invariants()
    took_s = time.monotonic() - now_s
    if len(DEBUG.next_check_s) >= _SAMPLED_MAX_TRACKED:
        DEBUG.next_check_s.clear()  # ids of structures long gone: start over, checks run sooner
    DEBUG.next_check_s[key] = now_s + took_s / SAMPLED_SHARE


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
            if DEBUG.sampled:
                _sampled_check(self)
            else:
                self.check_invariants()
        return result

    return wrapper  # type: ignore[return-value]
