"""Authentication and authorisation on a real daemon (issue 10, item 2).

A daemon started with ``--credentials`` answers a call without a token, or with a token it
does not know, UNAUTHENTICATED before doing anything; a tenant token may register and use
only the namespace digests listed for it; the admin views need the admin token; TLS with
a self-signed certificate works and a plaintext client gets no answer; a non-loopback
listener without credentials and TLS is refused at config validation (nothing is bound).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import DaemonHandle

from kvpool import KVSpec, PoolClient
from kvpool.cli.main import main as cli_main
from kvpool.client.admin import PoolAdmin
from kvpool.client.async_client import AsyncPoolClient
from kvpool.core.auth import token_sha256
from kvpool.core.config import DaemonConfig, is_loopback_address
from kvpool.core.errors import InvalidArgument, KVPoolError, PermissionDenied, Unauthenticated, Unavailable
from kvpool.core.spec import Namespace
from kvpool.proto import pool_pb2, pool_pb2_grpc
from kvpool.rpc.errors import from_rpc_error

SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
TOKENS = list(range(7000, 7000 + 16 * 4))
TOKEN_A = "kvp_tenant-a-token-for-tests"
TOKEN_B = "kvp_tenant-b-token-for-tests"
TOKEN_ADMIN = "kvp_admin-token-for-tests"
NS_A = Namespace(SPEC, b"salt-a").digest()
NS_A2 = Namespace(SPEC, b"salt-a-second").digest()
NS_B = Namespace(SPEC, b"salt-b").digest()


def make_blocks(n: int, seed: int) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 2**16, size=(n, *SPEC.block_shape), dtype=np.uint16)
    return raw.view(np.float16)


def write_credentials(directory: str, toml: bool = False) -> str:
    tenants = [
        {"name": "tenant-a", "token_sha256": token_sha256(TOKEN_A), "namespaces": [NS_A.hex(), NS_A2.hex()]},
        {"name": "tenant-b", "token_sha256": token_sha256(TOKEN_B), "namespaces": [NS_B.hex()]},
    ]
    admins = [{"name": "ops", "token_sha256": token_sha256(TOKEN_ADMIN)}]
    if toml:
        path = os.path.join(directory, "credentials.toml")
        lines = []
        for t in tenants:
            names = ", ".join(f'"{ns}"' for ns in t["namespaces"])
            lines += ["[[tenants]]", f'name = "{t["name"]}"', f'token_sha256 = "{t["token_sha256"]}"']
            lines += [f"namespaces = [{names}]", ""]
        lines += ["[[admins]]", 'name = "ops"', f'token_sha256 = "{admins[0]["token_sha256"]}"']
        text = "\n".join(lines) + "\n"
    else:
        path = os.path.join(directory, "credentials.json")
        text = json.dumps({"tenants": tenants, "admins": admins})
    with open(path, "w") as fh:
        fh.write(text)
    return path


@pytest.fixture
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvpool-auth-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def auth_daemon(daemon_factory: Any, workdir: str) -> DaemonHandle:
    handle: DaemonHandle = daemon_factory("--credentials", write_credentials(workdir, toml=True))
    return handle


def raw_error(address: str, method: str, request: Any, token: str = "") -> KVPoolError:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
        getattr(pool_pb2_grpc.PoolStub(channel), method)(request, timeout=10.0, metadata=metadata)
    return from_rpc_error(info.value, address)


def test_no_token_and_a_wrong_token_are_refused_on_every_call(auth_daemon: DaemonHandle) -> None:
    address = auth_daemon.address
    hashes = pool_pb2.HashesRequest(namespace=NS_A, hashes=b"\0" * 16)
    requests = {
        "Stats": pool_pb2.StatsRequest(),
        "Lookup": hashes,
        "Lease": hashes,
        "PutStart": hashes,
        "Remove": hashes,
        "Release": pool_pb2.ReleaseRequest(lease_ids=[1]),
        "PutCommit": pool_pb2.PutCommitRequest(put_id=1),
        "PutAbort": pool_pb2.PutAbortRequest(put_id=1),
        "Pin": pool_pb2.PinRequest(namespace=NS_A, hashes=b"\0" * 16, hard=True),
        "Snapshot": pool_pb2.SnapshotRequest(all_namespaces=True),
    }
    for token in ("", "kvp_not-a-token-the-daemon-knows", TOKEN_A + "x", TOKEN_A[:-1]):
        for method, request in requests.items():
            err = raw_error(address, method, request, token)
            assert isinstance(err, Unauthenticated), (method, token, err)
            assert "token" in err.hint
    with pytest.raises(Unauthenticated):
        PoolClient.connect(address, SPEC, salt=b"salt-a")
    with pytest.raises(Unauthenticated):
        PoolClient.connect(address, SPEC, salt=b"salt-a", token=TOKEN_B + "0")
    with pytest.raises(Unauthenticated):
        next(iter(PoolAdmin(address).events()))
    # a bearer token of the right length but another scheme is not a token either
    metadata = (("authorization", f"Basic {TOKEN_ADMIN}"),)
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
        pool_pb2_grpc.PoolStub(channel).Stats(pool_pb2.StatsRequest(), timeout=10.0, metadata=metadata)
    assert isinstance(from_rpc_error(info.value, address), Unauthenticated)


def test_a_tenant_token_uses_only_its_own_namespaces(auth_daemon: DaemonHandle) -> None:
    address = auth_daemon.address
    with (
        PoolClient.connect(address, SPEC, salt=b"salt-a", token=TOKEN_A) as a,
        PoolClient.connect(address, SPEC, salt=b"salt-a-second", token=TOKEN_A) as a2,
    ):
        hashes = a.hashes(TOKENS)
        assert a.put(hashes, make_blocks(4, seed=1)).stored == 4
        assert a.lookup(hashes) == 4 and a.get(hashes).shape[0] == 4
        assert a2.put(a2.hashes(TOKENS), make_blocks(4, seed=2)).stored == 4
        own = a.stats()
        assert [ns["digest"] for ns in own["namespaces"]] == [NS_A.hex()]  # no other tenant listed
        assert len(a.snapshot()[1]) == 4
        # tenant B's token cannot register A's namespace, nor act in it with hand-made calls
        with pytest.raises(PermissionDenied) as refused:
            PoolClient.connect(address, SPEC, salt=b"salt-a", token=TOKEN_B)
        assert NS_A.hex() in refused.value.message and "credentials file" in refused.value.hint
        with PoolClient.connect(address, SPEC, salt=b"salt-b", token=TOKEN_B) as b:
            b.put(b.hashes(TOKENS)[:1], make_blocks(1, seed=3))
            request = pool_pb2.HashesRequest(namespace=NS_A, hashes=b"".join(hashes))
            for method in ("Lookup", "Lease", "PutStart", "Remove"):
                assert isinstance(raw_error(address, method, request, TOKEN_B), PermissionDenied), method
            pin = pool_pb2.PinRequest(namespace=NS_A, hashes=b"".join(hashes), hard=True)
            assert isinstance(raw_error(address, "Pin", pin, TOKEN_B), PermissionDenied)
            scoped = pool_pb2.SnapshotRequest(namespace=NS_A)
            assert isinstance(raw_error(address, "Snapshot", scoped, TOKEN_B), PermissionDenied)
            with pytest.raises(PermissionDenied):
                next(iter(PoolAdmin(address, namespace=NS_A, token=TOKEN_B).events()))
            # B's Stats names only B, even when it asks about A
            asked = PoolAdmin(address, namespace=NS_A, token=TOKEN_B).stats()
            assert asked["namespaces"] == []
            # no admin view for a tenant
            with pytest.raises(PermissionDenied):
                PoolAdmin(address, token=TOKEN_B).snapshot()
            with pytest.raises(PermissionDenied):
                next(iter(PoolAdmin(address, token=TOKEN_A).events()))
        assert a.lookup(hashes) == 4 and a.get(hashes).shape[0] == 4  # A lost nothing


def test_the_admin_token_gets_the_admin_views(auth_daemon: DaemonHandle) -> None:
    address = auth_daemon.address
    with (
        PoolClient.connect(address, SPEC, salt=b"salt-a", token=TOKEN_A) as a,
        PoolClient.connect(address, SPEC, salt=b"salt-b", token=TOKEN_B) as b,
    ):
        a.put(a.hashes(TOKENS), make_blocks(4, seed=4))
        b.put(b.hashes(TOKENS)[:2], make_blocks(2, seed=5))
        with PoolAdmin(address, token=TOKEN_ADMIN) as admin:
            listed = {ns["digest"] for ns in admin.stats()["namespaces"]}
            assert listed == {NS_A.hex(), NS_B.hex()}
            last_seq, every = admin.snapshot()
            assert len(every) == 6 and last_seq >= 2
            first = next(iter(admin.events(from_seq=1)))
            assert first.seq == 1
        # the CLI: --token, else KVPOOL_TOKEN (read only in the CLI)
        assert cli_main(["inspect", "stats", "--json", "--address", address, "--token", TOKEN_ADMIN]) == 0
        assert cli_main(["inspect", "blocks", "--address", address, "--token", TOKEN_B]) == 1
        os.environ["KVPOOL_TOKEN"] = TOKEN_ADMIN
        try:
            assert cli_main(["inspect", "namespaces", "--address", address]) == 0
        finally:
            del os.environ["KVPOOL_TOKEN"]
        assert cli_main(["inspect", "namespaces", "--address", address]) == 1


def test_the_async_client_sends_its_token(auth_daemon: DaemonHandle) -> None:
    async def run() -> int:
        client = await AsyncPoolClient.connect(auth_daemon.address, SPEC, salt=b"salt-a", token=TOKEN_A)
        try:
            hashes = client.hashes(TOKENS)
            await client.put(hashes, make_blocks(4, seed=6))
            return await client.lookup(hashes)
        finally:
            await client.close()

    assert asyncio.run(run()) == 4

    async def refused() -> None:
        await AsyncPoolClient.connect(auth_daemon.address, SPEC, salt=b"salt-a", token=TOKEN_B)

    with pytest.raises(PermissionDenied):
        asyncio.run(refused())


def test_admin_views_off_stays_off_even_for_the_admin(daemon_factory: Any, workdir: str) -> None:
    daemon: DaemonHandle = daemon_factory("--credentials", write_credentials(workdir), "--admin-views", "off")
    with pytest.raises(PermissionDenied):
        PoolAdmin(daemon.address, token=TOKEN_ADMIN).snapshot()
    with PoolClient.connect(daemon.address, SPEC, salt=b"salt-b", token=TOKEN_B) as b:
        assert b.put(b.hashes(TOKENS), make_blocks(4, seed=7)).stored == 4


def test_a_bad_credentials_file_stops_the_daemon_at_start(daemon_factory: Any, workdir: str) -> None:
    path = os.path.join(workdir, "bad.json")
    with open(path, "w") as fh:
        json.dump({"tenants": [{"name": "t", "token_sha256": TOKEN_A, "namespaces": []}]}, fh)  # plaintext, not a hash
    with pytest.raises(RuntimeError, match="token_sha256"):
        daemon_factory("--credentials", path)


def _self_signed(directory: str) -> tuple[str, str]:
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", key, "-out", cert],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a certificate")
def test_tls_with_a_self_signed_certificate(daemon_factory: Any, workdir: str) -> None:
    cert, key = _self_signed(workdir)
    with open(cert, "rb") as fh:
        root = fh.read()
    daemon: DaemonHandle = daemon_factory(
        "--credentials", write_credentials(workdir), "--tls-cert-file", cert, "--tls-key-file", key,
        tls_root_certs=root,
    )  # fmt: skip
    with PoolClient.connect(daemon.address, SPEC, salt=b"salt-a", token=TOKEN_A, tls_root_certs=root) as a:
        hashes = a.hashes(TOKENS)
        assert a.put(hashes, make_blocks(4, seed=8)).stored == 4
        assert a.get(hashes).shape[0] == 4
    # a plaintext client gets no answer from a TLS listener (even with a valid token)
    with pytest.raises(Unavailable):
        PoolClient.connect(daemon.address, SPEC, salt=b"salt-a", token=TOKEN_A, timeout_s=3.0)
    # TLS without a token is still refused by the credentials
    with pytest.raises(Unauthenticated):
        PoolClient.connect(daemon.address, SPEC, salt=b"salt-a", tls_root_certs=root)
    # the CLI with the CA file
    args = ["inspect", "stats", "--address", daemon.address, "--token", TOKEN_ADMIN, "--tls-ca", cert]
    assert cli_main(args) == 0


def test_a_non_loopback_listener_needs_credentials_and_tls_or_insecure() -> None:
    """Config validation only: nothing is bound (0.0.0.0 is never used in tests)."""
    assert is_loopback_address("127.0.0.2:7450") and is_loopback_address("[::1]:7450")
    assert is_loopback_address("localhost:7450")
    assert not is_loopback_address("10.1.2.3:7450") and not is_loopback_address("pool.example:7450")
    with pytest.raises(InvalidArgument, match="--credentials and --tls-cert-file") as refused:
        DaemonConfig(listen="10.1.2.3:7450")
    assert "--insecure" in refused.value.hint
    with pytest.raises(InvalidArgument, match="without --tls-cert-file"):
        DaemonConfig(listen="10.1.2.3:7450", credentials_file="creds.json")
    with pytest.raises(InvalidArgument, match="without --credentials"):
        DaemonConfig(listen="10.1.2.3:7450", tls_cert_file="c.pem", tls_key_file="k.pem")
    DaemonConfig(listen="10.1.2.3:7450", credentials_file="c.json", tls_cert_file="c.pem", tls_key_file="k.pem")
    DaemonConfig(listen="10.1.2.3:7450", insecure=True)
    DaemonConfig(listen="127.0.0.2:7450")  # any 127.0.0.0/8 address is loopback
    from kvpool.core.config import ClusterConfig

    with pytest.raises(InvalidArgument, match=r"10\.1\.2\.3:7460"):
        DaemonConfig(cluster=ClusterConfig(data_listen="10.1.2.3:7460"))
    with pytest.raises(InvalidArgument, match="both"):
        DaemonConfig(tls_cert_file="c.pem")


def test_serve_refuses_a_non_loopback_listener_before_binding(capsys: Any) -> None:
    """``kvpool serve --listen 10.x`` exits at validation; ``--insecure`` is a switch."""
    from kvpool.cli.main import build_parser
    from kvpool.daemon.config_loader import load_config

    args = build_parser().parse_args(["serve", "--listen", "10.1.2.3:7450"])
    with pytest.raises(InvalidArgument, match="refusing to listen"):
        load_config(args, {})
    args = build_parser().parse_args(["serve", "--listen", "10.1.2.3:7450", "--insecure"])
    assert load_config(args, {}).insecure is True
    assert load_config(build_parser().parse_args(["serve", "--listen", "10.1.2.3:7450"]), {"KVPOOL_INSECURE": "1"})


def wait_for_port(address: str, timeout_s: float = 10.0) -> None:
    import socket
    import time

    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_data_plane_peers_are_admitted_only_with_a_credential(daemon_factory: Any, workdir: str) -> None:
    """The TCP data plane of a node with credentials: a peer reads / writes only after
    AUTH with a ticket the node's control plane issued for its token (the token never
    crosses the data plane) and only in the namespaces that token may use."""
    from conftest import free_port

    from kvpool.client.tickets import StaticTickets
    from kvpool.core.tickets import DataTicket
    from kvpool.transport.base import ReadItem
    from kvpool.transport.tcp import TcpTransport

    data_address = f"127.0.0.1:{free_port()}"
    daemon: DaemonHandle = daemon_factory(
        "--credentials", write_credentials(workdir), "--data-listen", data_address
    )  # fmt: skip
    wait_for_port(data_address)  # the data plane starts right after the control plane answers
    with (
        PoolClient.connect(daemon.address, SPEC, salt=b"salt-a", token=TOKEN_A) as a,
        PoolClient.connect(daemon.address, SPEC, salt=b"salt-b", token=TOKEN_B) as b,
        PoolClient.connect(daemon.address, SPEC, salt=b"salt-a", token=TOKEN_ADMIN) as admin,
    ):
        hashes = a.hashes(TOKENS)
        blocks = make_blocks(4, seed=9)
        assert a.put(hashes, blocks).stored == 4
        items = [ReadItem(h) for h in hashes]
        expected = blocks.reshape(4, -1).view(np.uint8)

        def transport_with(ticket: DataTicket | None) -> TcpTransport:
            transport = TcpTransport(timeout_s=5.0)
            transport.use_tickets(StaticTickets(ticket) if ticket is not None else None)
            return transport

        def read(ticket: DataTicket | None) -> tuple[int, str, np.ndarray]:
            transport = transport_with(ticket)
            dst = np.zeros((4, SPEC.block_bytes), dtype=np.uint8)
            try:
                result = transport.read(data_address, NS_A, items, list(dst))
            finally:
                transport.close()
            return result.ok, result.reason, dst

        ok, _, dst = read(a.data_ticket)
        assert ok == 4 and np.array_equal(dst, expected)
        for ticket in (None, b.data_ticket):  # no AUTH; B's ticket in A's namespace (DENIED)
            ok, reason, dst = read(ticket)
            assert ok == 0 and reason, ticket
            assert not dst.any()  # not one byte of A arrived
        # a write into A's namespace without A's credential stores nothing
        for ticket in (None, b.data_ticket):
            transport = transport_with(ticket)
            try:
                rows = make_blocks(4, seed=10).reshape(4, -1).view(np.uint8)
                fresh = a.hashes([t + 1 for t in TOKENS])
                written = transport.write(data_address, NS_A, fresh, rows)
            finally:
                transport.close()
            assert written.stored == 0, ticket
            assert a.lookup(fresh) == 0
        # the admin token may use every namespace on the data plane too
        ok, _, dst = read(admin.data_ticket)
        assert ok == 4 and np.array_equal(dst, expected)


def test_the_arena_is_handed_only_to_admitted_clients(auth_daemon: DaemonHandle) -> None:
    """Issue 10 item 3: with credentials the arena is memfds with no path, one per segment
    (per-tenant arenas); a client gets a read-only descriptor of a segment of its own
    tenant for its token, never one of another tenant's, and a writable one only while it
    holds a put."""
    import mmap

    from kvpool.core.arena_segments import SegmentedMapping
    from kvpool.transport.arena_handoff import receive_arena_segment

    assert auth_daemon.arena_files() == []  # no arena file any process of the uid could open
    with (
        PoolClient.connect(auth_daemon.address, SPEC, salt=b"salt-a", token=TOKEN_A) as a,
        PoolClient.connect(auth_daemon.address, SPEC, salt=b"salt-b", token=TOKEN_B) as b,
    ):
        assert isinstance(a._arena, SegmentedMapping) and isinstance(b._arena, SegmentedMapping)
        socket_path = a._arena.path
        assert socket_path.endswith(".sock") and oct(os.stat(socket_path).st_mode & 0o777) == "0o600"
        assert not a._arena.writable and a._arena.mapped_segments() == []  # nothing mapped before a lease or put
        hashes = a.hashes(TOKENS)
        blocks = make_blocks(4, seed=11)
        assert a.put(hashes, blocks).stored == 4
        np.testing.assert_array_equal(a.get(hashes), blocks)
        (seg_a,) = a._arena.mapped_segments()
        assert b.put(b.hashes(TOKENS), blocks).stored == 4
        (seg_b,) = b._arena.mapped_segments()
        assert seg_a != seg_b
        # the token is checked; a writable descriptor needs a put in flight; another tenant's
        # segment is refused whatever the request
        for token, mode, put_id, seg in (
            ("", "r", 0, seg_a),
            ("kvp_wrong", "r", 0, seg_a),
            (TOKEN_A, "w", 12345, seg_a),
            (TOKEN_B, "w", 1, seg_b),
            (TOKEN_B, "r", 0, seg_a),
            (TOKEN_A, "r", 0, seg_b),
            (TOKEN_B, "r", 0, 10**6),
        ):
            with pytest.raises(PermissionDenied):
                receive_arena_segment(socket_path, mode, put_id, seg, token)
        ro, _ = receive_arena_segment(socket_path, "r", 0, seg_b, TOKEN_B)  # its own segment, read-only
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(ro, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(OSError):
                os.ftruncate(ro, 0)
        finally:
            os.close(ro)
        assert a._arena.can_write and not a._arena.writable  # a write descriptor, still a read-only view
        with pytest.raises(PermissionError):  # sealed: no holder can shrink it under the daemon
            os.ftruncate(a._arena._write_fds[seg_a][0], 0)
        np.testing.assert_array_equal(a.get(hashes), blocks)


def test_the_router_follows_a_pool_with_its_tenant_token(auth_daemon: DaemonHandle) -> None:
    from kvpool.scheduler.router_events import PoolSource

    with PoolClient.connect(auth_daemon.address, SPEC, salt=b"salt-a", token=TOKEN_A) as a:
        a.put(a.hashes(TOKENS)[:2], make_blocks(2, seed=12))
    source = PoolSource(auth_daemon.address, SPEC, b"salt-a", token=TOKEN_A)
    try:
        assert len(source.snapshot()[1]) == 2
    finally:
        source.close()
    with pytest.raises(Unauthenticated):
        PoolSource(auth_daemon.address, SPEC, b"salt-a")
