"""Typed errors across gRPC: the server aborts with the ErrorCode's status code and puts
the code's wire name and the hint in trailing metadata; the client rebuilds the same
typed exception. A daemon that cannot be reached becomes ``Unavailable`` naming the address."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from kvpool.core.errors import (
    DeadlineExceeded,
    ErrorCode,
    InternalError,
    InvalidArgument,
    KVPoolError,
    Unauthenticated,
    Unavailable,
    error_from_code,
)

log = logging.getLogger("kvpool.rpc")

CODE_KEY = "kvpool-error-code"
HINT_KEY = "kvpool-error-hint"
_STATUS_BY_NUMBER = {s.value[0]: s for s in grpc.StatusCode}

F = TypeVar("F", bound=Callable[..., Any])

#: an unexpected exception in a handler logs its traceback at most once per method per this
#: many seconds (a client that triggers it in a loop must not fill the disk with logs)
INTERNAL_LOG_INTERVAL_S = 60.0


class RateLimitedLog:
    """Logs one line per ``kind`` per ``interval_s``, with how many were held back since.
    Bounded state: the kinds are method names (a fixed set)."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float,
        now: Callable[[], float] = time.monotonic,
        level: int = logging.WARNING,
    ) -> None:
        self._log = logger
        self._level = level
        self._interval_s = interval_s
        self._now = now
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def _take(self, kind: str) -> int | None:
        """Take ``kind``'s log slot: how many were held back since, or None (held now)."""
        now = self._now()
        with self._lock:
            if now < self._next.get(kind, 0.0):
                self._held[kind] = self._held.get(kind, 0) + 1
                return None
            self._next[kind] = now + self._interval_s
            return self._held.pop(kind, 0)

    def emit(self, kind: str, message: str) -> bool:
        """Log ``message`` unless ``kind`` was logged within the interval. True if logged."""
        held = self._take(kind)
        if held is None:
            return False
        suffix = f" ({held} more like it in the last {self._interval_s:.0f} s not logged)" if held else ""
        self._log.log(self._level, "%s%s", message, suffix)
        return True

    def would_log(self, kind: str) -> bool:
        """Take a log slot for ``kind`` (the caller logs, e.g. with a traceback) or count it held."""
        return self._take(kind) is not None


_INTERNAL = RateLimitedLog(log, INTERNAL_LOG_INTERVAL_S)


def status_for(code: ErrorCode) -> grpc.StatusCode:
    return _STATUS_BY_NUMBER[code.grpc_status]


def abort_with(context: grpc.ServicerContext, err: KVPoolError) -> None:
    context.set_trailing_metadata(((CODE_KEY, err.code.wire_name), (HINT_KEY, err.hint)))
    context.abort(status_for(err.code), err.message)


def typed_handler(method: F) -> F:
    """Wrap a servicer method: KVPoolError -> its status; anything else -> INTERNAL, logged.
    The daemon keeps serving either way."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except KVPoolError as err:
            abort_with(context, err)
        except Exception as exc:  # a bug: report it, keep the daemon up
            if _INTERNAL.would_log(method.__name__):
                log.exception("internal error in %s", method.__name__)
            abort_with(context, InternalError(f"{type(exc).__name__}: {exc}", hint="see the daemon log"))
        return None  # unreachable: abort raises

    return wrapper  # type: ignore[return-value]


class TlsFailed(Unavailable):
    """A TLS handshake with the peer failed: its certificate is not signed by the CA the
    client was given, does not name the address dialled, or one side speaks plaintext.
    Configuration, not an outage: retrying does not help (docs/security.md, TLS). An
    ``Unavailable`` on the wire and to callers that catch that; raised only client-side."""


#: what gRPC's details say when a TLS handshake failed (an unknown CA, a wrong name, a
#: plaintext peer): lower-case fragments of BoringSSL's and gRPC core's messages
_TLS_FAILURE_WORDS = ("ssl", "handshake", "certificate", "tls")
TLS_HINT = (
    "a TLS server needs its CA certificate on the client (tls_root_certs=..., --tls-ca / "
    "--directory-tls-ca), a certificate naming the address dialled, and a plaintext server a "
    "plaintext client: docs/security.md, TLS"
)


def looks_like_tls_failure(details: str) -> bool:
    """Whether an UNAVAILABLE call's details name a TLS handshake failure."""
    low = details.lower()
    return any(word in low for word in _TLS_FAILURE_WORDS)


def from_rpc_error(exc: grpc.RpcError, address: str) -> KVPoolError:
    """The typed error for a failed call to the daemon at ``address``."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    metadata: dict[str, Any] = {}
    if hasattr(exc, "trailing_metadata"):
        pairs: Any = exc.trailing_metadata() or ()
        metadata = {str(item[0]): item[1] for item in pairs}
    wire = metadata.get(CODE_KEY)
    if isinstance(wire, str):
        hint = metadata.get(HINT_KEY, "")
        return error_from_code(ErrorCode.from_wire_name(wire), str(details), str(hint))
    if code == grpc.StatusCode.UNAVAILABLE and looks_like_tls_failure(str(details)):
        return TlsFailed(
            f"TLS with {address} failed ({details})",
            hint=TLS_HINT,
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(
            f"the kvpool daemon at {address} is not reachable ({details})",
            hint=f"start it with 'kvpool serve --listen {address}' or check the address",
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(
            f"the kvpool daemon at {address} refused the call's credential ({details})",
            hint="pass the token the operator issued (token=..., --token or KVPOOL_TOKEN)",
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"the kvpool daemon at {address} did not answer in time", hint="is it overloaded?")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # gRPC's own message size limit, before our code
        return InvalidArgument(
            f"a message to or from {address} is larger than gRPC allows ({details})", hint="split the batch"
        )
    return InternalError(f"call to {address} failed: {code} {details}")
