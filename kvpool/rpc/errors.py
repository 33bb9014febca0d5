"""Typed errors across gRPC: the server aborts with the ErrorCode's status code and puts
the code's wire name and the hint in trailing metadata; the client rebuilds the same
typed exception. A daemon that cannot be reached becomes ``Unavailable`` naming the address."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from kvpool.core.errors import (
    DeadlineExceeded,
    ErrorCode,
    InternalError,
    KVPoolError,
    Unavailable,
    error_from_code,
)

log = logging.getLogger("kvpool.rpc")

CODE_KEY = "kvpool-error-code"
HINT_KEY = "kvpool-error-hint"
_STATUS_BY_NUMBER = {s.value[0]: s for s in grpc.StatusCode}

F = TypeVar("F", bound=Callable[..., Any])


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
            log.exception("internal error in %s", method.__name__)
            abort_with(context, InternalError(f"{type(exc).__name__}: {exc}", hint="see the daemon log"))
        return None  # unreachable: abort raises

    return wrapper  # type: ignore[return-value]


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
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(
            f"the kvpool daemon at {address} is not reachable ({details})",
            hint=f"start it with 'kvpool serve --listen {address}' or check the address",
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"the kvpool daemon at {address} did not answer in time", hint="is it overloaded?")
    return InternalError(f"call to {address} failed: {code} {details}")
