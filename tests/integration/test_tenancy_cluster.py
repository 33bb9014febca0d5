"""Tenant B against tenant A on a real 3-node cluster (etcd + directory + 3 daemons).

The directory keys its holders by (namespace, hash): a Lookup, Remove or Pin that B sends
with A's hashes finds no holder, and a Remove can no longer make A's blocks invisible to A
while answering ``removed: 0`` (issue 10). The data plane reads nothing of A for B either.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from kvpool.client.cluster_client import ClusterClient
from kvpool.core.hashing import pack_hashes
from kvpool.core.spec import KVSpec
from kvpool.daemon.cluster_local import LocalCluster, etcd_binary, eventually
from kvpool.proto import directory_pb2, directory_pb2_grpc

pytestmark = [
    pytest.mark.etcd,
    pytest.mark.skipif(etcd_binary() is None, reason="etcd binary not installed (apt-get install etcd-server)"),
]

SPEC = KVSpec(model="tiny", num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 15, size=(n, *SPEC.block_shape)).astype(np.float16)


@pytest.fixture
def cluster(tmp_path) -> Iterator[LocalCluster]:  # type: ignore[no-untyped-def]
    with LocalCluster(str(tmp_path)) as c:
        c.start_etcd()
        yield c


def test_tenant_b_cannot_remove_pin_or_read_tenant_a_through_the_cluster(cluster: LocalCluster) -> None:
    d = cluster.start_directory()
    a_addr, _, c_addr = (cluster.start_node(name, [d.address]).address for name in ("node-a", "node-b", "node-c"))
    with (
        ClusterClient.connect(SPEC, salt=b"tenant-a", directory=[d.address], local=a_addr, timeout_s=3.0) as a,
        ClusterClient.connect(SPEC, salt=b"tenant-b", directory=[d.address], local=c_addr, timeout_s=3.0) as b,
    ):
        hashes = a.hashes(np.arange(16 * 64))
        data = blocks(64, 1)
        assert a.put(hashes, data).stored == 64
        assert eventually(lambda: a.lookup(hashes) == 64)
        assert b.lookup(hashes) == 0
        out = np.zeros_like(data)
        assert b.get_into(hashes, out) == 0  # neither the directory nor a node's data plane serves it
        assert b.pin(hashes) == 0
        # the reported case: a directory Remove with B's namespace and A's hashes
        with grpc.insecure_channel(d.address) as channel:
            reply = directory_pb2_grpc.DirectoryStub(channel).Remove(
                directory_pb2.RemoveRequest(namespace=b.namespace.digest(), hashes=pack_hashes(hashes[32:])),
                timeout=5,
            )
        assert (reply.removed, reply.deferred) == (0, 0)
        assert b.remove(hashes) == 0
        assert a.lookup(hashes) == 64  # A still sees every block: no holder was forgotten
        assert a.get_into(hashes, out) == 64
        np.testing.assert_array_equal(out, data)
        # B's own put under A's hashes sits beside A's blocks
        forged = blocks(64, 2)
        assert b.put(hashes, forged).stored == 64
        assert eventually(lambda: b.lookup(hashes) == 64)
        assert a.get_into(hashes, out) == 64
        np.testing.assert_array_equal(out, data)
        assert b.remove(hashes) == 64
        assert eventually(lambda: b.lookup(hashes) == 0)
        assert a.lookup(hashes) == 64
