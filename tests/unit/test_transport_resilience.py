"""Data-plane resilience against a real PoolNode arena: a node restarted on the same port
must not cost the readers and writers one miss per stale pooled socket, and a store that
cannot lease (max_leases) answers with an error status instead of dropping the connection."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import transport_helpers as helpers
from transport_helpers import BB, NS_DIGEST, blocks, keys, make_node

from kvpool.core.keys import block_keys
from kvpool.daemon.cluster_node import NodeBlockStore
from kvpool.daemon.node import PoolNode
from kvpool.transport.base import ReadItem
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_server import TcpDataServer

node, transport = helpers.node, helpers.transport  # the shared fixtures


def test_node_restarted_on_the_same_port_costs_no_miss(node: PoolNode, transport: TcpTransport) -> None:
    """Pooled sockets to the old process are dead: the request is retried once on a fresh
    connection (nothing was received into the caller's rows yet), so reads and writes hit."""
    server = TcpDataServer(NodeBlockStore(node), "127.0.0.1:0")
    server.start()
    address = server.address
    ks, data = keys(3), blocks(3, 1)
    assert transport.write(address, NS_DIGEST, ks, data).stored == 3  # pools one socket
    server.stop()
    restarted = TcpDataServer(NodeBlockStore(node), address)
    restarted.start()
    try:
        out = np.zeros_like(data)
        result = transport.read(address, NS_DIGEST, [ReadItem(k) for k in ks], list(out))
        assert result.ok == 3, result.reason
        np.testing.assert_array_equal(out, data)
        restarted.stop()
        again = TcpDataServer(NodeBlockStore(node), address)
        again.start()
        try:  # a write on a stale pooled socket is retried too (content-addressed: idempotent)
            more = transport.write(address, NS_DIGEST, keys(2, 10), blocks(2, 2))
            assert more.reason == "" and more.stored == 2
        finally:
            again.stop()
    finally:
        restarted.stop()


def test_stale_socket_is_retried_only_once(node: PoolNode, transport: TcpTransport) -> None:
    """A peer that is really gone stays a miss (one retry, then the failure is reported)."""
    server = TcpDataServer(NodeBlockStore(node), "127.0.0.1:0")
    server.start()
    address = server.address
    ks = keys(1, 20)
    transport.write(address, NS_DIGEST, ks, blocks(1, 3))
    server.stop()
    out = np.zeros((1, BB), dtype=np.uint8)
    result = transport.read(address, NS_DIGEST, [ReadItem(ks[0])], list(out))
    assert result.ok == 0 and address in result.reason
    assert not out.any()


def test_lease_limit_is_an_error_reply_and_the_connection_stays(
    tmp_path, transport: TcpTransport, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    node = make_node(tmp_path, max_leases=1)
    server = TcpDataServer(NodeBlockStore(node), "127.0.0.1:0")
    server.start()
    try:
        ks, data = keys(2, 30), blocks(2, 4)
        assert transport.write(server.address, NS_DIGEST, ks, data).stored == 2
        (sock,) = transport._idle[server.address]
        held = node.store.lease(block_keys(NS_DIGEST, ks[:1]))  # the node's only read lease
        out = np.zeros_like(data)
        with caplog.at_level(logging.WARNING, logger="kvpool.transport"):
            result = transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out))
        assert result.ok == 0 and "max_leases" in result.reason and server.address in result.reason
        assert "max_leases" in caplog.text and server.address in caplog.text
        assert not out.any()
        assert transport._idle[server.address] == [sock]  # answered, not dropped: same connection
        node.store.release(held.lease_id)
        assert transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out)).ok == 2
        assert transport._idle[server.address] == [sock]
        np.testing.assert_array_equal(out, data)
    finally:
        server.stop()
        transport.close()
        node.close()
