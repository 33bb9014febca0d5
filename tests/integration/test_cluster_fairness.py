"""Per-tenant fairness beyond the node's control plane (issue 10): the directory and the TCP
data plane, on real processes.

- The directory gates its calls per tenant with the node's policy (``TenantGate``): tenant B
  sending the largest lookups back to back runs out of its rate and is refused typed
  ``TENANT_BUSY``, having done nothing, while tenant A's lookups through ``ClusterClient``
  all answer right; B's own ``ClusterClient`` sees a miss, never an exception.
- The TCP data plane bounds the transfers one tenant has in flight: while B holds a large
  read open, B's next read is answered BUSY (a miss: 0 blocks, a reason) and its write is
  refused (nothing stored) on a connection that stays usable, while A's reads and writes
  are served with the right bytes; once B's read ends, B is served again.
"""

from __future__ import annotations

import socket
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import DaemonHandle, free_port

from kvpool import KVSpec, PoolClient
from kvpool.client.cluster_client import ClusterClient
from kvpool.core.errors import TenantBusy
from kvpool.core.hashing import block_hashes
from kvpool.core.spec import Namespace
from kvpool.daemon.cluster_local import LocalCluster, eventually
from kvpool.directory.service import MAX_BATCH_BLOCKS
from kvpool.proto import directory_pb2, directory_pb2_grpc
from kvpool.rpc.errors import from_rpc_error
from kvpool.transport import wire
from kvpool.transport.base import ReadItem
from kvpool.transport.tcp import TcpTransport

SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
#: 1 MiB blocks: a read of 64 of them outlasts every socket buffer on loopback
BIG = KVSpec(model="fair-big", num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16", block_tokens=32)


def test_the_directory_refuses_a_flooding_tenant_past_its_rate(tmp_path: Any) -> None:
    limits = ["--tenant-rate-units-per-s", "10", "--tenant-wait-ms", "20"]
    with LocalCluster(str(tmp_path)) as cluster:
        d = cluster.start_directory(etcd=False, extra=limits)
        node = cluster.start_node("node-0", [d.address], etcd=False)
        with (
            ClusterClient.connect(SPEC, b"salt-a", directory=[d.address], local=node.address) as a,
            ClusterClient.connect(SPEC, b"salt-b", directory=[d.address], local=node.address) as b,
        ):
            blocks = np.random.default_rng(2).integers(0, 1 << 15, size=(4, *SPEC.block_shape)).astype(np.float16)
            h = a.hashes(np.arange(16 * 4))
            assert a.put(h, blocks).stored == 4
            assert eventually(lambda: a.lookup(h) == 4)
            # B: the largest lookups the directory takes (cost 257 units each, capped at one budget)
            flood = directory_pb2.LookupRequest(
                namespace=Namespace(SPEC, b"salt-b").digest(),
                hashes=np.random.default_rng(3).bytes(16 * MAX_BATCH_BLOCKS),
            )
            outcomes = []
            with grpc.insecure_channel(d.address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
                stub = directory_pb2_grpc.DirectoryStub(channel)
                for _ in range(4):
                    try:
                        outcomes.append(stub.Lookup(flood, timeout=30).hits)
                    except grpc.RpcError as exc:
                        assert isinstance(from_rpc_error(exc, d.address), TenantBusy), exc
                        outcomes.append(-1)
            assert outcomes[:2] == [0, 0] and -1 in outcomes[2:], outcomes  # a burst, then its rate
            assert b.lookup(b.hashes(np.arange(16 * 4))) == 0  # B's client: a miss, not an exception
            out = np.zeros_like(blocks)
            for _ in range(20):  # A is untouched: its own bucket
                assert a.lookup(h) == 4
            assert a.get_into(h, out) == 4
            np.testing.assert_array_equal(out, blocks)
            stats = a.link.call("Stats", directory_pb2.StatsRequest())
            assert '"tenant_calls_refused": ' in stats.json


def _read(transport: TcpTransport, address: str, namespace: bytes, hashes: list[bytes]) -> tuple[int, str, np.ndarray]:
    dst = np.zeros((len(hashes), BIG.block_bytes), dtype=np.uint8)
    result = transport.read(address, namespace, [ReadItem(x) for x in hashes], list(dst))
    return result.ok, result.reason, dst


def test_the_tcp_data_plane_bounds_a_tenants_transfers_in_flight(daemon_factory: Any) -> None:
    data_address = f"127.0.0.1:{free_port()}"
    daemon: DaemonHandle = daemon_factory(
        "--data-listen", data_address, "--tenant-data-transfers", "1", "--tenant-wait-ms", "20",
        capacity="256MiB",
    )  # fmt: skip
    rng = np.random.default_rng(4)
    with (
        PoolClient.connect(daemon.address, BIG, salt=b"salt-a") as a,
        PoolClient.connect(daemon.address, BIG, salt=b"salt-b") as b,
    ):
        ns_a, ns_b = a.namespace.digest(), b.namespace.digest()
        blocks_a = rng.integers(0, 1 << 15, size=(4, *BIG.block_shape)).astype(np.float16)
        h_a = block_hashes(a.namespace, list(range(BIG.block_tokens * 4)))
        assert a.put(h_a, blocks_a).stored == 4
        h_b = block_hashes(b.namespace, list(range(BIG.block_tokens * 64)))
        for i in range(0, 64, 16):
            assert b.put(h_b[i : i + 16], np.ones((16, *BIG.block_shape), np.float16)).stored == 16
        rows_a = blocks_a.reshape(4, -1).view(np.uint8)

        transport = TcpTransport(timeout_s=10.0)
        host, port = data_address.rsplit(":", 1)
        hold = socket.create_connection((host, int(port)), timeout=10.0)
        try:
            # B's 64 MiB read, admitted and sending: its reply header arrived, its bytes are not read
            hold.sendall(wire.pack_header(wire.OP_READ, 64, ns_b) + wire.pack_read_items([(x, 0, 0) for x in h_b]))
            status, served, _ = wire.recv_reply(hold)
            assert status == wire.STATUS_OK and served == 64

            ok, reason, dst = _read(transport, data_address, ns_b, h_b[:4])  # B's second transfer: BUSY
            assert ok == 0 and "refused" in reason and not dst.any()
            refused = transport.write(data_address, ns_b, block_hashes(b.namespace, [7] * BIG.block_tokens),
                                      np.zeros((1, BIG.block_bytes), np.uint8))  # fmt: skip
            assert refused.stored == 0 and "refused" in refused.reason
            ok, _, dst = _read(transport, data_address, ns_a, h_a)  # A: its own share
            assert ok == 4
            np.testing.assert_array_equal(dst, rows_a)
            fresh = block_hashes(a.namespace, [5] * (BIG.block_tokens * 2))
            assert transport.write(data_address, ns_a, fresh, np.full((2, BIG.block_bytes), 3, np.uint8)).stored == 2
        finally:
            hold.close()  # B's read ends (the server's send fails): its share is free again
        assert eventually(lambda: _read(transport, data_address, ns_b, h_b[:4])[0] == 4)
        transport.close()
        assert a.lookup(fresh) == 2 and b.lookup(h_b) == 64  # nothing of A's was refused; B's blocks intact


@pytest.mark.parametrize("limit", ["-1"])
def test_negative_data_plane_limits_are_refused(limit: str) -> None:
    from kvpool.core.config import DaemonConfig
    from kvpool.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="tenant-data"):
        DaemonConfig(tenant_data_transfers=int(limit))
