"""Typed errors across a real gRPC server: server raise -> abort -> client typed exception."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from conftest import free_port

from kvpool.core.errors import (
    DeadlineExceeded,
    ErrorCode,
    InternalError,
    KVPoolError,
    Unavailable,
    error_from_code,
)
from kvpool.rpc.errors import from_rpc_error, status_for, typed_handler

METHOD = "/kvpool.test.Errors/Raise"


class _Servicer:
    """Raises the error whose wire name is the request body."""

    @typed_handler
    def Raise(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        name = request.decode()
        if name == "ok":
            return b"fine"
        if name == "plain":
            raise ZeroDivisionError("a bug")
        code = ErrorCode.from_wire_name(name)
        raise error_from_code(code, f"message for {name}", f"hint for {name}")


@pytest.fixture(scope="module")
def server_address() -> Iterator[str]:
    servicer = _Servicer()
    handler = grpc.method_handlers_generic_handler(
        "kvpool.test.Errors",
        {"Raise": grpc.unary_unary_rpc_method_handler(servicer.Raise)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    address = f"127.0.0.1:{free_port()}"
    assert server.add_insecure_port(address)
    server.start()
    try:
        yield address
    finally:
        server.stop(0).wait()


def _call(address: str, body: bytes, timeout: float = 5.0) -> Any:
    with grpc.insecure_channel(address) as channel:
        return channel.unary_unary(METHOD, None, None)(body, timeout=timeout)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_code_round_trips_through_grpc(server_address: str, code: ErrorCode) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _call(server_address, code.wire_name.encode())
    exc = info.value
    assert exc.code() == status_for(code)  # type: ignore[attr-defined]
    assert exc.code().value[0] == code.grpc_status  # type: ignore[attr-defined]
    typed = from_rpc_error(exc, server_address)
    assert typed.code is code
    assert type(typed) is type(error_from_code(code, "", ""))
    assert typed.message == f"message for {code.wire_name}"
    assert typed.hint == f"hint for {code.wire_name}"


def test_unexpected_exception_becomes_internal_and_server_keeps_serving(server_address: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _call(server_address, b"plain")
    typed = from_rpc_error(info.value, server_address)
    assert isinstance(typed, InternalError)
    assert "ZeroDivisionError" in typed.message and "a bug" in typed.message
    assert _call(server_address, b"ok") == b"fine"


def test_unreachable_daemon_is_unavailable_naming_the_address() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(grpc.RpcError) as info:
        _call(address, b"ok", timeout=3.0)
    typed = from_rpc_error(info.value, address)
    assert isinstance(typed, Unavailable)
    assert address in typed.message
    assert address in typed.hint and "kvpool serve" in typed.hint


def test_deadline_without_metadata_is_deadline_exceeded() -> None:
    class _Fake(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.DEADLINE_EXCEEDED

        def details(self) -> str:
            return "slow"

        def trailing_metadata(self) -> tuple[()]:
            return ()

    typed = from_rpc_error(_Fake(), "127.0.0.1:1")
    assert isinstance(typed, DeadlineExceeded) and "127.0.0.1:1" in typed.message


def test_unknown_wire_name_in_metadata_becomes_internal() -> None:
    class _Fake(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.NOT_FOUND

        def details(self) -> str:
            return "??"

        def trailing_metadata(self) -> tuple[tuple[str, str], ...]:  # type: ignore[override]
            return (("kvpool-error-code", "FROM_THE_FUTURE"), ("kvpool-error-hint", "h"))

    typed = from_rpc_error(_Fake(), "a:1")
    assert isinstance(typed, KVPoolError) and typed.code is ErrorCode.INTERNAL
