"""Hypothesis strategies and the answer check shared by the RPC fuzz tests: any request
bytes get OK or a typed kvpool error, never INTERNAL, never a hang."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import strategies as st

from kvpool.rpc.errors import CODE_KEY

CALL_TIMEOUT_S = 10.0
STREAM_WAIT_S = 0.5  # an Events stream with nothing to send yet is open, not hung


def send(channel: grpc.Channel, service: Any, method: str, raw: bytes) -> None:
    """Call ``service``'s ``method`` with ``raw`` as the request bytes; the answer must be OK
    or a typed kvpool error other than INTERNAL (an open Events stream may just wait)."""
    path = f"/{service.full_name}/{method}"
    streaming = service.methods_by_name[method].server_streaming
    try:
        if streaming:
            stream = channel.unary_stream(path)(raw, timeout=STREAM_WAIT_S)
            for _ in stream:
                break
            stream.cancel()
        else:
            channel.unary_unary(path)(raw, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        if streaming and code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            return
        metadata = dict(exc.trailing_metadata() or ())  # type: ignore[attr-defined]
        wire = metadata.get(CODE_KEY)
        assert wire is not None, f"{method}: untyped {code} {exc.details()}"  # type: ignore[attr-defined]
        assert wire != "INTERNAL", f"{method}: INTERNAL {exc.details()}"  # type: ignore[attr-defined]


def field_values(module: ModuleType, field: FieldDescriptor, namespace: bytes, depth: int) -> st.SearchStrategy[Any]:
    t = field.type
    if t == FieldDescriptor.TYPE_BYTES:
        return st.one_of(
            st.just(namespace),
            st.binary(min_size=16, max_size=16),
            st.binary(max_size=80),
            st.integers(0, 70_000).map(lambda n: bytes(16 * n)),  # up to past max_batch_blocks
        )
    if t == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(["kvpool-h1", "kvpool.v1", "float16", "mha", "m"]), st.text(max_size=400))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1))
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1))
    if t == FieldDescriptor.TYPE_MESSAGE and depth < 2:
        return message_of(module, field.message_type, namespace, depth + 1)
    return st.none()


def message_of(module: ModuleType, descriptor: Any, namespace: bytes, depth: int = 0) -> st.SearchStrategy[bytes]:
    """Serialized messages of ``descriptor`` (a message of the generated ``module``) with
    arbitrary values in any subset of its fields."""
    cls = getattr(module, descriptor.name)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        values = field_values(module, field, namespace, depth)
        if field.is_repeated:
            values = st.lists(values, max_size=5000)
        fields[field.name] = st.one_of(st.none(), values)

    def build(chosen: dict[str, Any]) -> bytes:
        msg = cls()
        for name, value in chosen.items():
            if value is None:
                continue
            if isinstance(value, list) and descriptor.fields_by_name[name].type == FieldDescriptor.TYPE_MESSAGE:
                for item in value:
                    getattr(msg, name).add().MergeFromString(item)
            elif isinstance(value, list):
                getattr(msg, name).extend(value)
            elif isinstance(value, bytes) and descriptor.fields_by_name[name].type == FieldDescriptor.TYPE_MESSAGE:
                getattr(msg, name).MergeFromString(value)
            else:
                setattr(msg, name, value)
        return bytes(msg.SerializeToString())

    return st.fixed_dictionaries(fields).map(build)
