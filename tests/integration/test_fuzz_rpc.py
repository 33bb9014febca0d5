"""Hypothesis against a real daemon: every Pool RPC, with raw bytes and with well-formed
messages of arbitrary field values (issue 10, item 5).

Every answer is OK or a typed kvpool error (its code in the trailing metadata), never
INTERNAL; no call hangs (each has a deadline; an Events stream may stay open and wait);
the daemon keeps serving the tenant that was there before, byte for byte, and logs no
traceback and at most a bounded number of lines for all that bad input.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import DaemonHandle, start_daemon
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool import KVSpec, PoolClient
from kvpool.proto import pool_pb2
from kvpool.rpc.errors import CODE_KEY

SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
TOKENS = list(range(9000, 9000 + 16 * 4))
SERVICE = pool_pb2.DESCRIPTOR.services_by_name["Pool"]
METHODS = [m.name for m in SERVICE.methods]
CALL_TIMEOUT_S = 10.0
STREAM_WAIT_S = 0.5  # an Events stream with nothing to send yet is open, not hung
#: log lines the daemon may write for the whole fuzz run (rate-limited warnings, start-up)
MAX_LOG_LINES = 200


class Fuzzed:
    def __init__(self, daemon: DaemonHandle, tenant: PoolClient, hashes: list[bytes], blocks: np.ndarray) -> None:
        self.daemon = daemon
        self.tenant = tenant
        self.namespace = tenant.namespace.digest()
        self.hashes = hashes
        self.blocks = blocks
        self.channel = grpc.insecure_channel(daemon.address)


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Fuzzed]:
    daemon = start_daemon("--max-namespaces", "64", "--put-ttl-ms", "2000", capacity="32MiB")
    tenant = PoolClient.connect(daemon.address, SPEC, salt=b"victim")
    try:
        hashes = tenant.hashes(TOKENS)
        blocks = np.random.default_rng(7).integers(0, 2**16, size=(4, *SPEC.block_shape), dtype=np.uint16)
        assert tenant.put(hashes, blocks.view(np.float16)).stored == 4
        assert tenant.pin(hashes) == 4  # the fuzzer's own puts may fill the arena: keep these
        state = Fuzzed(daemon, tenant, hashes, blocks.view(np.float16))
        yield state
        state.channel.close()
    finally:
        tenant.close()
        daemon.cleanup()


def send(f: Fuzzed, method: str, raw: bytes) -> None:
    """Call ``method`` with ``raw`` as the request bytes and check the answer's shape."""
    path = f"/{SERVICE.full_name}/{method}"
    streaming = SERVICE.methods_by_name[method].server_streaming
    try:
        if streaming:
            stream = f.channel.unary_stream(path)(raw, timeout=STREAM_WAIT_S)
            for _ in stream:
                break
            stream.cancel()
        else:
            f.channel.unary_unary(path)(raw, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        if streaming and code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            return
        metadata = dict(exc.trailing_metadata() or ())  # type: ignore[attr-defined]
        wire = metadata.get(CODE_KEY)
        assert wire is not None, f"{method}: untyped {code} {exc.details()}"  # type: ignore[attr-defined]
        assert wire != "INTERNAL", f"{method}: INTERNAL {exc.details()}"  # type: ignore[attr-defined]


def field_values(field: FieldDescriptor, namespace: bytes, depth: int) -> st.SearchStrategy[Any]:
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
        return message_of(field.message_type, namespace, depth + 1)
    return st.none()


def message_of(descriptor: Any, namespace: bytes, depth: int = 0) -> st.SearchStrategy[bytes]:
    """Serialized messages of ``descriptor`` with arbitrary values in any subset of fields."""
    cls = getattr(pool_pb2, descriptor.name)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        values = field_values(field, namespace, depth)
        if field.is_repeated:
            values = st.lists(values, max_size=5000)
        fields[field.name] = st.one_of(st.none(), values)

    def build(chosen: dict[str, Any]) -> bytes:
        msg = cls()
        for name, value in chosen.items():
            if value is None:
                continue
            if isinstance(value, list):
                getattr(msg, name).extend(value)
            elif isinstance(value, bytes) and descriptor.fields_by_name[name].type == FieldDescriptor.TYPE_MESSAGE:
                getattr(msg, name).MergeFromString(value)
            else:
                setattr(msg, name, value)
        return bytes(msg.SerializeToString())

    return st.fixed_dictionaries(fields).map(build)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(METHODS), raw=st.binary(max_size=2048))
def test_raw_bytes_to_every_rpc_get_typed_answers(fuzzed: Fuzzed, method: str, raw: bytes) -> None:
    send(fuzzed, method, raw)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), method=st.sampled_from(METHODS))
def test_well_formed_messages_with_any_values_get_typed_answers(fuzzed: Fuzzed, data: Any, method: str) -> None:
    descriptor = SERVICE.methods_by_name[method].input_type
    send(fuzzed, method, data.draw(message_of(descriptor, fuzzed.namespace)))


def test_after_the_fuzzing_the_tenant_reads_its_blocks_and_the_log_is_bounded(fuzzed: Fuzzed) -> None:
    assert fuzzed.daemon.proc.poll() is None
    assert fuzzed.tenant.get(fuzzed.hashes).tobytes() == fuzzed.blocks.tobytes()
    log = fuzzed.daemon.stderr()
    assert "Traceback" not in log
    assert len(log.splitlines()) <= MAX_LOG_LINES
