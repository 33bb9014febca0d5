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
from fuzz_helpers import message_of, send
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool import KVSpec, PoolClient
from kvpool.proto import pool_pb2

SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
TOKENS = list(range(9000, 9000 + 16 * 4))
SERVICE = pool_pb2.DESCRIPTOR.services_by_name["Pool"]
METHODS = [m.name for m in SERVICE.methods]
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


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(METHODS), raw=st.binary(max_size=2048))
def test_raw_bytes_to_every_rpc_get_typed_answers(fuzzed: Fuzzed, method: str, raw: bytes) -> None:
    send(fuzzed.channel, SERVICE, method, raw)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), method=st.sampled_from(METHODS))
def test_well_formed_messages_with_any_values_get_typed_answers(fuzzed: Fuzzed, data: Any, method: str) -> None:
    descriptor = SERVICE.methods_by_name[method].input_type
    send(fuzzed.channel, SERVICE, method, data.draw(message_of(pool_pb2, descriptor, fuzzed.namespace)))


def test_after_the_fuzzing_the_tenant_reads_its_blocks_and_the_log_is_bounded(fuzzed: Fuzzed) -> None:
    assert fuzzed.daemon.proc.poll() is None
    assert fuzzed.tenant.get(fuzzed.hashes).tobytes() == fuzzed.blocks.tobytes()
    log = fuzzed.daemon.stderr()
    assert "Traceback" not in log
    assert len(log.splitlines()) <= MAX_LOG_LINES
