"""Register a gRPC servicer so that every request, however malformed, gets a typed answer.

Why not the generated ``add_XServicer_to_server``: with it gRPC decodes the request before
our code runs, and a message that does not parse (random bytes, a string field that is not
UTF-8) is answered INTERNAL with no kvpool code and a traceback in the log, once per
message. Here the handlers receive the raw bytes; ``decode_request`` checks their size
against the service's limit and parses them, so an oversized or undecodable message is
``InvalidArgument`` naming the method, and the log gets at most one line per interval for
such input (``RateLimitedLog``), never a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvpool.core.errors import InvalidArgument, KVPoolError
from kvpool.rpc.errors import RateLimitedLog, abort_with

log = logging.getLogger("kvpool.rpc")

#: at most one log line per kind of bad input per this many seconds
BAD_INPUT_LOG_INTERVAL_S = 10.0


BAD_INPUT = RateLimitedLog(log, BAD_INPUT_LOG_INTERVAL_S)


def decode_request(raw: bytes, request_cls: Any, method: str, max_request_bytes: int) -> Any:
    """The parsed request, or InvalidArgument (oversized / undecodable), logged rate-limited."""
    if len(raw) > max_request_bytes:
        BAD_INPUT.emit(method, f"{method}: refused a {len(raw)}-byte request (limit {max_request_bytes})")
        raise InvalidArgument(
            f"{method} request is {len(raw)} bytes; the limit is {max_request_bytes} bytes",
            hint="split the batch",
        )
    try:
        return request_cls.FromString(raw)
    except (DecodeError, ValueError, TypeError, RuntimeError) as exc:
        BAD_INPUT.emit(method, f"{method}: refused an undecodable request ({type(exc).__name__})")
        raise InvalidArgument(
            f"{method} request is not a valid {request_cls.DESCRIPTOR.full_name} message",
            hint="use a kvpool client of the same version",
        ) from None


def _unary(impl: Callable[..., Any], request_cls: Any, method: str, limit: int) -> Callable[..., Any]:
    def handler(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            request = decode_request(raw, request_cls, method, limit)
        except KVPoolError as err:
            abort_with(context, err)
        return impl(request, context)

    return handler


def _stream(impl: Callable[..., Iterator[Any]], request_cls: Any, method: str, limit: int) -> Callable[..., Any]:
    def handler(raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            request = decode_request(raw, request_cls, method, limit)
        except KVPoolError as err:
            abort_with(context, err)
        yield from impl(request, context)

    return handler


@dataclass(frozen=True)
class TypedMethod:
    """One method of a service: ``handler(raw request bytes, context)`` decodes the request
    (``decode_request``) and runs the servicer's method; ``reply_cls`` is its reply type."""

    name: str
    handler: Callable[..., Any]
    reply_cls: Any
    server_streaming: bool


def typed_methods(servicer: object, module: ModuleType, service: str, max_request_bytes: int) -> dict[str, TypedMethod]:
    """``servicer``'s methods for ``service`` of the generated ``module`` (e.g. ``pool_pb2``,
    "Pool"), by name: what gRPC serves (``add_typed_service``) and what the daemon's
    same-host socket serves (``kvpool.daemon.local_calls``), so both run the same code."""
    descriptor = module.DESCRIPTOR.services_by_name[service]
    methods: dict[str, TypedMethod] = {}
    for method in descriptor.methods:
        if method.client_streaming:
            raise InvalidArgument(f"{service}.{method.name}: client streaming is not supported here")
        request_cls = getattr(module, method.input_type.name)
        impl = getattr(servicer, method.name)
        wrap = _stream if method.server_streaming else _unary
        methods[method.name] = TypedMethod(
            method.name,
            wrap(impl, request_cls, method.name, max_request_bytes),
            getattr(module, method.output_type.name),
            method.server_streaming,
        )
    return methods


def add_typed_service(
    server: grpc.Server, servicer: object, module: ModuleType, service: str, max_request_bytes: int
) -> dict[str, TypedMethod]:
    """Serve ``typed_methods(...)`` on ``server``; returns them."""
    methods = typed_methods(servicer, module, service, max_request_bytes)
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for name, method in methods.items():
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(method.handler, response_serializer=method.reply_cls.SerializeToString)
    descriptor = module.DESCRIPTOR.services_by_name[service]
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))
    return methods
