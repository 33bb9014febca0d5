"""TLS on the directory: a real directory with credentials and a self-signed certificate,
three real nodes (TLS control planes too) that join it over TLS with the cluster token, and
the clients of it: ``ClusterClient`` with the CA works; without it, or in plaintext, the
client fails with a typed ``Unavailable`` that names TLS; a plaintext node cannot join;
the directory forwards pins to the nodes over TLS (``--node-tls-ca``); ``kvpool inspect
nodes --directory`` with ``--directory-tls-ca``; a non-loopback directory without TLS is
refused at config validation (nothing bound); the router's event follower (``PoolSource``,
``kvpool router --tls-ca``) reads a TLS pool with the CA."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import numpy as np
import pytest
from test_auth import _self_signed

from kvpool import KVSpec
from kvpool.cli.main import main as cli_main
from kvpool.client.cluster_client import ClusterClient
from kvpool.core.auth import token_sha256
from kvpool.core.errors import InvalidArgument, Unavailable
from kvpool.core.spec import Namespace
from kvpool.daemon.cluster_local import LocalCluster, eventually
from kvpool.directory.server import DirectoryConfig
from kvpool.proto import directory_pb2, directory_pb2_grpc
from kvpool.rpc.auth import call_metadata, make_channel
from kvpool.rpc.errors import TlsFailed

SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
TOKEN_A = "kvp_dir-tls-tenant-a"
TOKEN_CLUSTER = "kvp_dir-tls-nodes"
TOKEN_ADMIN = "kvp_dir-tls-admin"
NS_A = Namespace(SPEC, b"salt-a").digest()

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI (certificates)")


def _credentials(directory: str) -> tuple[str, str]:
    creds = os.path.join(directory, "credentials.json")
    with open(creds, "w") as fh:
        json.dump(
            {
                "tenants": [{"name": "a", "token_sha256": token_sha256(TOKEN_A), "namespaces": [NS_A.hex()]}],
                "admins": [{"name": "ops", "token_sha256": token_sha256(TOKEN_ADMIN)}],
                "cluster": {"token_sha256": token_sha256(TOKEN_CLUSTER)},
            },
            fh,
        )
    token_file = os.path.join(directory, "cluster.token")
    with open(token_file, "w") as fh:
        fh.write(TOKEN_CLUSTER + "\n")
    return creds, token_file


def directory_nodes(address: str, root: bytes) -> list[str]:
    with make_channel(address, (), root) as channel:
        reply = directory_pb2_grpc.DirectoryStub(channel).Nodes(
            directory_pb2.NodesRequest(), timeout=10.0, metadata=call_metadata(TOKEN_ADMIN)
        )
    return [n.node_id for n in reply.nodes]


@needs_openssl
def test_a_tls_directory_with_three_tls_nodes(tmp_path: Any, capsys: Any) -> None:
    workdir = str(tmp_path)
    cert, key = _self_signed(workdir)
    os.makedirs(os.path.join(workdir, "other"))
    other_cert, _ = _self_signed(os.path.join(workdir, "other"))  # a CA that did not sign the directory's
    with open(cert, "rb") as fh:
        root = fh.read()
    with open(other_cert, "rb") as fh:
        wrong_root = fh.read()
    creds, token_file = _credentials(workdir)
    auth = ["--credentials", creds, "--cluster-token-file", token_file]
    tls = ["--tls-cert-file", cert, "--tls-key-file", key]
    with LocalCluster(workdir, token=TOKEN_CLUSTER, tls_root_certs=root) as cluster:
        d = cluster.start_directory(etcd=False, node_ttl_ms=3000, extra=[*auth, *tls, "--node-tls-ca", cert])
        node_args = [*auth, *tls, "--data-tls", "--directory-tls-ca", cert]
        nodes = [
            cluster.start_node(f"node-{i}", [d.address], etcd=False, host=f"host-{i}", extra=node_args)
            for i in range(3)
        ]
        data = np.random.default_rng(1).integers(0, 1 << 15, size=(5, *SPEC.block_shape)).astype(np.float16)

        def connect(local: str, directory_root: bytes | None, **kw: Any) -> ClusterClient:
            return ClusterClient.connect(
                SPEC,
                b"salt-a",
                directory=[d.address],
                local=local,
                token=TOKEN_A,
                tls_root_certs=root,
                directory_tls_root_certs=directory_root,
                **kw,
            )

        with connect(nodes[0].address, root) as c0, connect(nodes[2].address, root) as c2:
            h = c0.hashes(np.arange(16 * 5))
            assert c0.put(h, data).stored == 5
            assert eventually(lambda: c2.lookup(h) == 5)  # node-0 streamed its events over TLS
            out = np.zeros_like(data)
            assert c2.get_into(h, out) == 5
            np.testing.assert_array_equal(out, data)
            assert c2.pin(h[:2], ttl_ms=60_000) == 2  # forwarded by the directory over TLS to node-0
            assert c2.unpin(h[:2]) == 2
            nodes_reply = c2.link.call("Nodes", directory_pb2.NodesRequest())
            assert sorted(n.node_id for n in nodes_reply.nodes) == ["node-0", "node-1", "node-2"]

        # without the directory's CA (plaintext), and with a CA that did not sign it: typed, names TLS
        with pytest.raises(TlsFailed) as refused:  # configuration: raised at once, no failover waited out
            connect(nodes[1].address, wrong_root, timeout_s=3.0)
        assert "TLS" in str(refused.value) and "CA" in refused.value.hint
        with pytest.raises(Unavailable) as refused_plain:  # plaintext: the server just closes the socket
            connect(nodes[1].address, None, timeout_s=3.0, failover_wait_ms=0)
        assert "--directory-tls-ca" in refused_plain.value.hint

        # a node that dials the TLS directory in plaintext does not join, and its log says why
        plain_args = [*auth, *tls, "--directory", d.address]
        plain = cluster.start_node("node-plain", etcd=False, host="host-9", extra=plain_args)
        assert eventually(lambda: "--directory-tls-ca" in plain.log(), timeout_s=30)
        assert plain.popen.poll() is None  # it keeps retrying, it does not crash
        nodes_now = directory_nodes(d.address, root)
        assert "node-plain" not in nodes_now and len(nodes_now) == 3

        # the CLI: the directory's CA for the directory, the nodes' for the nodes
        argv = ["inspect", "nodes", "--directory", d.address, "--token", TOKEN_ADMIN, "--json"]
        assert cli_main([*argv, "--directory-tls-ca", cert, "--tls-ca", cert]) == 0
        rows = json.loads(capsys.readouterr().out)
        listed = rows["nodes"] if isinstance(rows, dict) else rows
        assert {r["node_id"] for r in listed} >= {"node-0", "node-1", "node-2"}
        assert cli_main(argv) != 0  # plaintext to the TLS directory: an error, not a traceback
        assert "directory" in capsys.readouterr().err


def test_a_non_loopback_directory_needs_credentials_and_tls_or_insecure() -> None:
    """Config validation only: nothing is bound."""
    with pytest.raises(InvalidArgument, match="--credentials and --tls-cert-file") as refused:
        DirectoryConfig(listen="10.1.2.3:7440")
    assert "--insecure" in refused.value.hint
    with pytest.raises(InvalidArgument, match="without --tls-cert-file"):
        DirectoryConfig(listen="10.1.2.3:7440", credentials_file="c.json")
    with pytest.raises(InvalidArgument, match="without --credentials"):
        DirectoryConfig(listen="10.1.2.3:7440", tls_cert_file="c.pem", tls_key_file="k.pem")
    DirectoryConfig(listen="10.1.2.3:7440", credentials_file="c.json", tls_cert_file="c.pem", tls_key_file="k.pem")
    DirectoryConfig(listen="10.1.2.3:7440", insecure=True)
    with pytest.raises(InvalidArgument, match="both"):
        DirectoryConfig(tls_cert_file="c.pem")


@needs_openssl
def test_the_routers_event_follower_reads_a_tls_pool(daemon_factory: Any, tmp_path: Any) -> None:
    """``kvpool router --pool A --tls-ca FILE``: its ``PoolSource`` snapshots and follows a
    pool that serves TLS with the CA, and gets nothing without it."""
    from test_auth import SPEC as POOL_SPEC
    from test_auth import TOKEN_A as POOL_TOKEN
    from test_auth import write_credentials

    from kvpool.scheduler.router_events import PoolSource

    cert, key = _self_signed(str(tmp_path))
    with open(cert, "rb") as fh:
        root = fh.read()
    daemon = daemon_factory(
        "--credentials", write_credentials(str(tmp_path)), "--tls-cert-file", cert, "--tls-key-file", key,
        tls_root_certs=root,
    )  # fmt: skip
    source = PoolSource(daemon.address, POOL_SPEC, b"salt-a", POOL_TOKEN, tls_root_certs=root)
    try:
        last_seq, hashes = source.snapshot()
        assert last_seq >= 0 and hashes == []
    finally:
        source.close()
    with pytest.raises(Unavailable):
        PoolSource(daemon.address, POOL_SPEC, b"salt-a", POOL_TOKEN)
