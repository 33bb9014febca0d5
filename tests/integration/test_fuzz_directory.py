"""Hypothesis against a real directory (no etcd) with one real node: every Directory RPC,
with raw bytes and with well-formed messages of arbitrary field values, gets OK or a
typed kvpool error, never INTERNAL, never a hang; afterwards the tenant that was there
still reads its blocks through the directory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from fuzz_helpers import message_of, send
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.client.cluster_client import ClusterClient
from kvpool.core.spec import KVSpec
from kvpool.daemon.cluster_local import LocalCluster, eventually
from kvpool.proto import directory_pb2

SPEC = KVSpec(model="tiny", num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)
SERVICE = directory_pb2.DESCRIPTOR.services_by_name["Directory"]
METHODS = [m.name for m in SERVICE.methods]


class Fuzzed:
    def __init__(self, directory: str, tenant: ClusterClient, hashes: list[bytes], blocks: np.ndarray) -> None:
        self.directory = directory
        self.tenant = tenant
        self.namespace = tenant.namespace.digest()
        self.hashes = hashes
        self.blocks = blocks
        self.channel = grpc.insecure_channel(directory)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    with LocalCluster(str(tmp_path_factory.mktemp("fuzzdir"))) as cluster:
        d = cluster.start_directory(etcd=False)
        node = cluster.start_node("node-a", [d.address], etcd=False)
        with ClusterClient.connect(SPEC, salt=b"victim", directory=[d.address], local=node.address) as tenant:
            hashes = tenant.hashes(np.arange(16 * 8))
            blocks = np.random.default_rng(3).integers(0, 1 << 15, size=(8, *SPEC.block_shape)).astype(np.float16)
            assert tenant.put(hashes, blocks).stored == 8
            assert eventually(lambda: tenant.lookup(hashes) == 8)
            assert tenant.pin(hashes) == 8  # the fuzzer's own calls must not evict these
            state = Fuzzed(d.address, tenant, hashes, blocks)
            yield state
            state.channel.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(METHODS), raw=st.binary(max_size=2048))
def test_raw_bytes_to_every_directory_rpc_get_typed_answers(fuzzed: Fuzzed, method: str, raw: bytes) -> None:
    send(fuzzed.channel, SERVICE, method, raw)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), method=st.sampled_from(METHODS))
def test_well_formed_directory_messages_get_typed_answers(fuzzed: Fuzzed, data: Any, method: str) -> None:
    descriptor = SERVICE.methods_by_name[method].input_type
    send(fuzzed.channel, SERVICE, method, data.draw(message_of(directory_pb2, descriptor, fuzzed.namespace)))


def test_after_the_fuzzing_the_tenant_still_reads_its_blocks(fuzzed: Fuzzed) -> None:
    out = np.zeros_like(fuzzed.blocks)
    assert eventually(lambda: fuzzed.tenant.get_into(fuzzed.hashes, out) == 8)
    np.testing.assert_array_equal(out, fuzzed.blocks)
