"""Credentials across a real loopback cluster (directory + three nodes on three "hosts", no
etcd): nodes register with the cluster token, tenants reach the directory and the remote
nodes' data planes only with their own token (a data-plane ticket from each node's control
plane) and only in their own namespaces; a tenant cannot release another's directory
leases, nor read the directory's node-wide counts (an admin view)."""

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
TOKEN_ADMIN = "kvp_cluster-test-admin"
NS_A = Namespace(SPEC, b"salt-a").digest()
NS_B = Namespace(SPEC, b"salt-b").digest()


def directory_call(address: str, method: str, request: Any, token: str) -> Any:
    with grpc.insecure_channel(address) as channel:
        return getattr(directory_pb2_grpc.DirectoryStub(channel), method)(
            request, timeout=10.0, metadata=(("authorization", f"Bearer {token}"),)
        )


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
                "admins": [{"name": "ops", "token_sha256": token_sha256(TOKEN_ADMIN)}],
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
        c = cluster.start_node("node-c", [d.address], etcd=False, host="host-3", extra=auth)
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

            # tenant B on the third node, in its own namespace, with A's hashes: 0 cross-tenant effects
            with ClusterClient.connect(SPEC, b"salt-b", directory=[d.address], local=c.address, token=TOKEN_B) as cc:
                out_b = np.zeros_like(data)
                assert cc.lookup(h) == 0 and cc.get_into(h, out_b) == 0 and not out_b.any()
                assert cc.pin(h, ttl_ms=60_000) == 0 and cc.unpin(h) == 0 and cc.remove(h) == 0
                b_data = np.ones_like(data)
                assert cc.put(h, b_data).stored == 6  # B's own blocks beside A's, never over them
                assert eventually(lambda: cc.lookup(h) == 6)
                assert cc.get_into(h, out_b) == 6
                np.testing.assert_array_equal(out_b, b_data)
                # B's data-plane ticket (from node-a's control plane) reads nothing of A on node-a
                holder = next(
                    n for n in cc.link.call("Nodes", directory_pb2.NodesRequest()).nodes if n.node_id == "node-a"
                )
                rows = np.zeros((6, SPEC.block_bytes), dtype=np.uint8)
                cc.tickets.learn(holder.data_address, holder.control_address)
                from kvpool.transport.base import ReadItem

                got = cc.transport.read(holder.data_address, NS_A, [ReadItem(x) for x in h], list(rows))
                assert got.ok == 0 and not rows.any()
                # B releases A's directory lease: ignored (random ids, checked against B's namespaces)
                leased = directory_call(
                    d.address,
                    "Lookup",
                    directory_pb2.LookupRequest(namespace=NS_A, hashes=pack_hashes(h), lease_ms=60_000),
                    TOKEN_A,
                )
                assert leased.hits == 6 and leased.lease_id > 1000
                release = directory_pb2.LeaseRelease(lease_ids=[leased.lease_id])
                assert directory_call(d.address, "Release", release, TOKEN_B).released == 0
                assert directory_call(d.address, "Release", release, TOKEN_A).released == 1
                # the directory's node-wide counts are an admin view; a tenant sees the nodes only
                tenant_view = json.loads(directory_call(d.address, "Stats", directory_pb2.StatsRequest(), TOKEN_B).json)
                assert "blocks" not in tenant_view and "namespaces" not in tenant_view and "lookups" not in tenant_view
                assert all("blocks" not in n for n in tenant_view["nodes"]) and len(tenant_view["nodes"]) == 3
                for token in (TOKEN_ADMIN, TOKEN_CLUSTER):
                    full = json.loads(directory_call(d.address, "Stats", directory_pb2.StatsRequest(), token).json)
                    assert full["blocks"] == 12 and full["namespaces"] == 2
            out = np.zeros_like(data)
            assert cb.lookup(h) == 6 and cb.get_into(h, out) == 6  # A lost nothing, read nothing of B
            np.testing.assert_array_equal(out, data)
