"""Credentials across a real loopback cluster (directory + two nodes on two "hosts", no
etcd): nodes register with the cluster token, tenants reach the directory and the remote
node's data plane only with their own token and only in their own namespaces."""

from __future__ import annotations

import json
import os
from typing import Any

import grpc
import numpy as np
import pytest

from kvpool import KVSpec
from kvpool.client.cluster_client import ClusterClient
from kvpool.core.auth import token_sha256
from kvpool.core.errors import KVPoolError, PermissionDenied, Unauthenticated
from kvpool.core.hashing import pack_hashes
from kvpool.core.spec import Namespace
from kvpool.daemon.cluster_local import LocalCluster, eventually
from kvpool.proto import directory_pb2, directory_pb2_grpc
from kvpool.rpc.errors import from_rpc_error

SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
TOKEN_A = "kvp_cluster-test-tenant-a"
TOKEN_B = "kvp_cluster-test-tenant-b"
TOKEN_CLUSTER = "kvp_cluster-test-nodes"
NS_A = Namespace(SPEC, b"salt-a").digest()
NS_B = Namespace(SPEC, b"salt-b").digest()


def directory_error(address: str, method: str, request: Any, token: str) -> KVPoolError:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
        getattr(directory_pb2_grpc.DirectoryStub(channel), method)(request, timeout=10.0, metadata=metadata)
    return from_rpc_error(info.value, address)


def test_a_cluster_with_credentials(tmp_path: Any) -> None:
    creds = os.path.join(tmp_path, "credentials.json")
    with open(creds, "w") as fh:
        json.dump(
            {
                "tenants": [
                    {"name": "a", "token_sha256": token_sha256(TOKEN_A), "namespaces": [NS_A.hex()]},
                    {"name": "b", "token_sha256": token_sha256(TOKEN_B), "namespaces": [NS_B.hex()]},
                ],
                "cluster": {"token_sha256": token_sha256(TOKEN_CLUSTER)},
            },
            fh,
        )
    token_file = os.path.join(tmp_path, "cluster.token")
    with open(token_file, "w") as fh:
        fh.write(TOKEN_CLUSTER + "\n")
    auth = ["--credentials", creds, "--cluster-token-file", token_file]
    with LocalCluster(str(tmp_path), token=TOKEN_CLUSTER) as cluster:
        d = cluster.start_directory(etcd=False, node_ttl_ms=3000, extra=auth)
        a = cluster.start_node("node-a", [d.address], etcd=False, host="host-1", extra=auth)
        b = cluster.start_node("node-b", [d.address], etcd=False, host="host-2", extra=auth)
        data = np.random.default_rng(0).integers(0, 1 << 15, size=(6, *SPEC.block_shape)).astype(np.float16)
        with (
            ClusterClient.connect(SPEC, b"salt-a", directory=[d.address], local=a.address, token=TOKEN_A) as ca,
            ClusterClient.connect(SPEC, b"salt-a", directory=[d.address], local=b.address, token=TOKEN_A) as cb,
        ):
            h = ca.hashes(np.arange(16 * 6))
            assert ca.put(h, data).stored == 6
            assert eventually(lambda: cb.lookup(h) == 6)
            out = np.zeros_like(data)
            assert cb.get_into(h, out) == 6  # node-b's client reads node-a over the authenticated data plane
            np.testing.assert_array_equal(out, data)
            assert cb.counters["remote_blocks"] == 6
            assert cb.pin(h[:3], ttl_ms=60_000) == 3  # forwarded by the directory with the cluster token
            assert cb.unpin(h[:3]) == 3

            lookup = directory_pb2.LookupRequest(namespace=NS_A, hashes=pack_hashes(h))
            assert isinstance(directory_error(d.address, "Lookup", lookup, ""), Unauthenticated)
            assert isinstance(directory_error(d.address, "Lookup", lookup, "kvp_wrong"), Unauthenticated)
            assert isinstance(directory_error(d.address, "Lookup", lookup, TOKEN_B), PermissionDenied)
            remove = directory_pb2.RemoveRequest(namespace=NS_A, hashes=pack_hashes(h))
            assert isinstance(directory_error(d.address, "Remove", remove, TOKEN_B), PermissionDenied)
            register = directory_pb2.RegisterRequest(
                node=directory_pb2.NodeInfo(node_id="rogue", data_address="127.0.0.1:1")
            )
            assert isinstance(directory_error(d.address, "Register", register, TOKEN_A), PermissionDenied)
            assert isinstance(directory_error(d.address, "Register", register, ""), Unauthenticated)
            # tenant B cannot even connect in A's namespace, on either node
            with pytest.raises(PermissionDenied):
                ClusterClient.connect(SPEC, b"salt-a", directory=[d.address], local=b.address, token=TOKEN_B)
            assert cb.lookup(h) == 6 and cb.get_into(h, out) == 6  # A lost nothing
