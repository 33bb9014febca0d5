"""Data-plane admission after the control plane (issue 10, item 2, last sentence) and TLS
on the TCP data plane, on real daemons.

A node with credentials admits a data-plane connection only with a ticket its own control
plane issued (``Hello``, with a token). What an attacker can have and still gets nothing:
the credentials file (the token hashes were the data-plane key before tickets), a tenant's
own ticket with another principal's index patched in, another node's ticket, or no AUTH.
With ``--data-tls`` the data plane is TLS: a plaintext peer and a peer that does not trust
the node's certificate get nothing, a tenant over TLS is still confined to its namespaces.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import socket
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import DaemonHandle, free_port
from test_auth import (
    NS_A,
    SPEC,
    TOKEN_A,
    TOKEN_B,
    TOKENS,
    _self_signed,
    make_blocks,
    wait_for_port,
    workdir,
    write_credentials,
)

from kvpool import PoolClient
from kvpool.client.tickets import StaticTickets
from kvpool.core.auth import token_sha256
from kvpool.core.hashing import block_hashes
from kvpool.core.spec import Namespace
from kvpool.core.tickets import DataTicket, ticket_proof
from kvpool.transport import wire
from kvpool.transport.base import ReadItem
from kvpool.transport.tcp import TcpTransport

_ = workdir  # the fixture is used by name


@pytest.fixture
def node(daemon_factory: Any, workdir: str) -> Iterator[tuple[DaemonHandle, str, PoolClient]]:
    data_address = f"127.0.0.1:{free_port()}"
    daemon: DaemonHandle = daemon_factory("--credentials", write_credentials(workdir), "--data-listen", data_address)
    wait_for_port(data_address)
    with PoolClient.connect(daemon.address, SPEC, salt=b"salt-a", token=TOKEN_A) as a:
        assert a.put(a.hashes(TOKENS), make_blocks(4, seed=31)).stored == 4
        yield daemon, data_address, a


def read_a(data_address: str, ticket: DataTicket | None, tls_root: bytes | None = None) -> tuple[int, np.ndarray]:
    """Read tenant A's 4 blocks at ``data_address`` proving ``ticket`` (None: no AUTH)."""
    transport = TcpTransport(timeout_s=5.0)
    transport.use_tickets(StaticTickets(ticket) if ticket is not None else None)
    transport.use_tls(tls_root)
    keys = block_hashes(Namespace(SPEC, b"salt-a"), TOKENS)
    dst = np.zeros((4, SPEC.block_bytes), dtype=np.uint8)
    try:
        result = transport.read(data_address, NS_A, [ReadItem(h) for h in keys], list(dst))
    finally:
        transport.close()
    return result.ok, dst


def raw_auth(data_address: str, body_for: Any) -> int:
    """One AUTH exchange on a raw socket with the proof body ``body_for(nonce)``: the status."""
    host, port = data_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5.0) as sock:
        sock.sendall(wire.pack_header(wire.OP_AUTH, 0, bytes(16)))
        status, count, _ = wire.recv_reply(sock)
        assert status == wire.STATUS_OK and count == 32
        nonce = wire.recv_exact(sock, count)
        body = body_for(nonce)
        sock.sendall(wire.pack_header(wire.OP_AUTH, len(body), bytes(16)) + body)
        status, _, _ = wire.recv_reply(sock)
        return status


def test_a_ticket_from_the_control_plane_admits_and_nothing_else_does(
    node: tuple[DaemonHandle, str, PoolClient],
) -> None:
    _, data_address, a = node
    ok, dst = read_a(data_address, a.data_ticket)
    assert ok == 4 and dst.any()
    assert raw_auth(data_address, lambda n: a.data_ticket.ticket_id + ticket_proof(a.data_ticket.key, n)) == 0
    # what a process that read the credentials file has: the token hashes. They were the
    # data-plane key before tickets; now they make no valid proof, in either frame
    digest = bytes.fromhex(token_sha256(TOKEN_A))
    old_proof = lambda n: hmac.new(digest, b"kvpool-data-auth-v1|" + n, hashlib.sha256).digest()  # noqa: E731
    assert raw_auth(data_address, old_proof) == wire.STATUS_BAD_REQUEST
    forged = a.data_ticket.ticket_id
    assert raw_auth(data_address, lambda n: forged + ticket_proof(digest, n)) == wire.STATUS_UNAUTHENTICATED
    ok, dst = read_a(data_address, DataTicket(forged, digest))
    assert ok == 0 and not dst.any()
    # a ticket id with a garbage key, and no AUTH at all
    assert read_a(data_address, DataTicket(forged, os.urandom(32)))[0] == 0
    ok, dst = read_a(data_address, None)
    assert ok == 0 and not dst.any()


def test_a_tenant_cannot_turn_its_ticket_into_another_principals(
    node: tuple[DaemonHandle, str, PoolClient],
) -> None:
    daemon, data_address, _ = node
    with PoolClient.connect(daemon.address, SPEC, salt=b"salt-b", token=TOKEN_B) as b:
        ticket = b.data_ticket
        assert ticket.ticket_id and ticket.key
        # B's own ticket in A's namespace: admitted, then DENIED (the namespace check)
        ok, dst = read_a(data_address, ticket)
        assert ok == 0 and not dst.any()
        # B patches the principal index (tenant-a is entry 0, the admin entry 2, the
        # cluster 0xFFFF) and the expiry into its ticket id: the key no longer matches
        version, index, expires_ms, rand = struct.unpack("<BHQ8s", ticket.ticket_id)
        assert index == 1
        for patched in (
            struct.pack("<BHQ8s", version, 0, expires_ms, rand),
            struct.pack("<BHQ8s", version, 2, expires_ms, rand),
            struct.pack("<BHQ8s", version, 0xFFFF, expires_ms, rand),
            struct.pack("<BHQ8s", version, 1, expires_ms + 10**9, rand),
        ):
            assert (
                raw_auth(data_address, lambda n, p=patched: p + ticket_proof(ticket.key, n))
                == wire.STATUS_UNAUTHENTICATED
            )
            ok, dst = read_a(data_address, DataTicket(patched, ticket.key))
            assert ok == 0 and not dst.any()


def test_a_ticket_admits_only_on_the_node_that_issued_it(
    node: tuple[DaemonHandle, str, PoolClient],
    daemon_factory: Any,
    workdir: str,
) -> None:
    """Each daemon makes its own secret at start: another node's ticket (or this node's from
    before a restart) is refused, with the same credentials file."""
    _, data_address, a = node
    other_data = f"127.0.0.1:{free_port()}"
    other: DaemonHandle = daemon_factory("--credentials", write_credentials(workdir), "--data-listen", other_data)
    wait_for_port(other_data)
    with PoolClient.connect(other.address, SPEC, salt=b"salt-a", token=TOKEN_A) as a2:
        assert a2.put(a2.hashes(TOKENS), make_blocks(4, seed=32)).stored == 4
        assert read_a(other_data, a.data_ticket)[0] == 0  # the first node's ticket
        assert read_a(data_address, a2.data_ticket)[0] == 0  # and the other way round
        assert read_a(other_data, a2.data_ticket)[0] == 4


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a certificate")
def test_the_tcp_data_plane_over_tls(daemon_factory: Any, workdir: str) -> None:
    cert, key = _self_signed(workdir)
    with open(cert, "rb") as fh:
        root = fh.read()
    os.makedirs(os.path.join(workdir, "other"))
    other_cert, _ = _self_signed(os.path.join(workdir, "other"))  # a certificate the node does not have
    with open(other_cert, "rb") as fh:
        wrong_root = fh.read()
    data_address = f"127.0.0.1:{free_port()}"
    daemon: DaemonHandle = daemon_factory(
        "--credentials", write_credentials(workdir), "--tls-cert-file", cert, "--tls-key-file", key,
        "--data-listen", data_address, "--data-tls", tls_root_certs=root,
    )  # fmt: skip
    wait_for_port(data_address)
    with (
        PoolClient.connect(daemon.address, SPEC, salt=b"salt-a", token=TOKEN_A, tls_root_certs=root) as a,
        PoolClient.connect(daemon.address, SPEC, salt=b"salt-b", token=TOKEN_B, tls_root_certs=root) as b,
    ):
        blocks = make_blocks(4, seed=33)
        assert a.put(a.hashes(TOKENS), blocks).stored == 4
        ok, dst = read_a(data_address, a.data_ticket, tls_root=root)
        assert ok == 4 and np.array_equal(dst, blocks.reshape(4, -1).view(np.uint8))
        # plaintext to a TLS listener, and TLS that does not trust the node's certificate: nothing
        for tls_root in (None, wrong_root):
            ok, dst = read_a(data_address, a.data_ticket, tls_root=tls_root)
            assert ok == 0 and not dst.any()
        # B over TLS is still confined to its namespace
        ok, dst = read_a(data_address, b.data_ticket, tls_root=root)
        assert ok == 0 and not dst.any()
        # a write over TLS lands and reads back
        transport = TcpTransport(timeout_s=5.0)
        transport.use_tickets(StaticTickets(a.data_ticket))
        transport.use_tls(root)
        try:
            fresh = a.hashes([t + 3 for t in TOKENS])
            rows = make_blocks(4, seed=34).reshape(4, -1).view(np.uint8)
            assert transport.write(data_address, NS_A, fresh, rows).stored == 4
        finally:
            transport.close()
        np.testing.assert_array_equal(a.get(fresh).reshape(4, -1).view(np.uint8), rows)


def test_data_tls_needs_the_control_planes_certificate(daemon_factory: Any, workdir: str) -> None:
    with pytest.raises(RuntimeError, match="data-tls"):
        daemon_factory("--credentials", write_credentials(workdir), "--data-listen", "127.0.0.1:0", "--data-tls")
