"""Per-tenant shares of a node's TCP data plane: how many transfers, and how many bytes
in them, one tenant may have in flight at once.

Why: every connection has its own worker thread, but they all copy out of (or into) one
arena under one store lock, on the same cores. One tenant reading the largest batches from
many connections at once would take the node's copy bandwidth and lock time from every
other tenant's reads (the control plane has the same bound: ``kvpool/core/fairness.py``).

The rule is the control plane's ``TenantGate`` with bytes for cost units: a READ or WRITE
of ``n`` blocks costs ``1 + n x block_bytes / 1 MiB`` units; a tenant may have at most
``--tenant-data-inflight-bytes`` of them in flight (a transfer alone is always admitted,
whatever its size) and at most ``--tenant-data-transfers`` transfers (running and waiting);
past that a transfer waits up to ``--tenant-wait-ms``, then is answered ``STATUS_BUSY``
having touched nothing in the store. The tenant is the ticket's principal (its credential's
tenant name); without credentials the request's namespace. The admin and the cluster
credential (other nodes) are not gated.

What a refused peer sees: a READ is answered BUSY and the connection stays in sync (its
item list, at most ``MAX_ITEMS`` x 32 bytes, is read and dropped); a WRITE's blocks are read
and dropped first (never written to the arena), then BUSY. The reader treats BUSY as it
treats any refusal: the blocks are misses (``TcpTransport``'s ``ReadResult.reason``), and a
writer's batch is "not stored". Only the TCP ops are gated: UCX and NIXL transfers start on
the same connection but move their bytes outside it (docs/security.md says so).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Hashable, Iterator

from kvpool.core.auth import Principal
from kvpool.core.errors import KVPoolError
from kvpool.core.fairness import TenantGate, tenant_key
from kvpool.transport import wire
from kvpool.transport.base import BlockStore

#: bytes of a transfer per cost unit (beyond its first)
DATA_UNIT_BYTES = 1 << 20
#: scratch buffer a refused WRITE's blocks are read into and dropped
DRAIN_CHUNK_BYTES = 1 << 20


class TransferShares:
    """The data plane's ``TenantGate``: ``admit`` around a transfer, ``refuse`` when it is busy."""

    def __init__(self, inflight_bytes: int, transfers: int, wait_ms: float) -> None:
        self.gate = TenantGate(max(0, inflight_bytes) // DATA_UNIT_BYTES, transfers, wait_ms)
        self.refused = 0

    @property
    def enabled(self) -> bool:
        return self.gate.enabled

    def admit(
        self, store: BlockStore, principal: Principal, named: bool, namespace: bytes, count: int, what: str
    ) -> contextlib.AbstractContextManager[None]:
        """The transfer's share (raises ``TenantBusy`` at entry when the tenant is past it)."""
        if not self.enabled or (named and (principal.admin or principal.cluster)):
            return contextlib.nullcontext()
        tenant: Hashable = tenant_key(named, principal.name, namespace)
        return self.gate.admit(tenant, self.cost(store, namespace, count), what)

    @staticmethod
    def cost(store: BlockStore, namespace: bytes, count: int) -> int:
        try:
            block_bytes = store.block_bytes(namespace)
        except KVPoolError:  # an unknown namespace: the transfer itself answers that
            block_bytes = 0
        return 1 + max(0, count) * block_bytes // DATA_UNIT_BYTES

    def refuse(self, conn: socket.socket, store: BlockStore, op: int, count: int, namespace: bytes, why: str) -> bool:
        """Read the refused request's remainder and answer BUSY; False when the stream cannot
        be kept in sync (a WRITE whose block size is not the namespace's): then close it."""
        self.refused += 1
        if op == wire.OP_WRITE:
            (block_bytes,) = wire.U64.unpack(wire.recv_exact(conn, wire.U64.size))
            try:
                expected = store.block_bytes(namespace)
            except KVPoolError:
                expected = -1
            if block_bytes != expected:
                conn.sendall(wire.pack_reply(wire.STATUS_BAD_REQUEST, 0, "block size is not the namespace's"))
                return False
            _drain(conn, count * wire.WRITE_ITEM.size + count * block_bytes)
        else:
            _drain(conn, count * wire.READ_ITEM.size)
        conn.sendall(wire.pack_reply(wire.STATUS_BUSY, 0, why[: wire.MAX_MESSAGE]))
        return True


def _drain(conn: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` of the request (bounded memory: one chunk)."""
    scratch = memoryview(bytearray(min(nbytes, DRAIN_CHUNK_BYTES)))
    for chunk in _chunks(nbytes):
        wire.recv_into_exact(conn, scratch[:chunk])


def _chunks(nbytes: int) -> Iterator[int]:
    while nbytes > 0:
        step = min(nbytes, DRAIN_CHUNK_BYTES)
        yield step
        nbytes -= step
