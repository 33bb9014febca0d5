"""Every thread of the TCP data server has an owner: one worker per open connection, at most
``max_connections``, all joined by ``TcpDataServer.stop`` before it returns, so none can touch the
node's arena after the node closes it (``kvpool/transport/tcp.py``)."""

from __future__ import annotations

import socket
import threading

import numpy as np
from transport_helpers import NS_DIGEST, blocks, keys, node  # noqa: F401  (fixture)

from kvpool.daemon.cluster_node import NodeBlockStore
from kvpool.daemon.node import PoolNode
from kvpool.transport.base import ReadItem
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_server import TcpDataServer


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvpool-data-conn") and t.is_alive()]


def test_stop_joins_every_connection_worker_and_refuses_past_the_bound(node: PoolNode) -> None:  # noqa: F811
    before = len(_workers())
    server = TcpDataServer(NodeBlockStore(node), "127.0.0.1:0", max_connections=3)
    server.start()
    transport = TcpTransport(timeout_s=2.0)
    idle: list[socket.socket] = []
    try:
        assert transport.write(server.address, NS_DIGEST, keys(2), blocks(2, 1)).stored == 2
        host, port = server.address.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port))) for _ in range(2)]  # idle peers: 3 open now
        out = [np.zeros(len(blocks(1, 0)[0]), dtype=np.uint8) for _ in range(2)]
        assert transport.read(server.address, NS_DIGEST, [ReadItem(k) for k in keys(2)], out).ok == 2
        extra = socket.create_connection((host, int(port)))  # the fourth: refused (closed by the server)
        extra.settimeout(2.0)
        assert extra.recv(1) == b""
        extra.close()
        assert len(_workers()) - before == 3
    finally:
        server.stop()  # returns only once every worker is done
        transport.close()
        for sock in idle:
            sock.close()
    assert len(_workers()) == before
