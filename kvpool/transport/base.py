"""What the data plane moves and the two sides it connects.

A *transport* moves block bytes between nodes (never through gRPC). The serving side
reads and writes a node's arena through the ``BlockStore`` protocol, which the daemon
implements over its ``HostStore``: every read happens under a store read lease (so the
slot cannot be evicted or reused while its bytes are on the wire) and every write is a
two-phase put (so a half-received block is never visible).

The reading side gets back how many *leading* items arrived and verified. A failed,
timed-out or corrupt transfer is a miss (logged with the peer's address), never an
exception: the engine recomputes what it did not get.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvpool.core.tickets import DataTicket


@dataclass(frozen=True)
class ReadItem:
    """One block (or a byte range of it: one layer, one head range) to read."""

    key: bytes  # 16-byte block hash
    range_offset: int = 0  # bytes from the start of the block
    range_length: int = 0  # 0 = to the end of the block


@dataclass(frozen=True)
class ReadResult:
    ok: int  # leading items copied into their destinations and verified
    reason: str = ""  # why the rest were misses ("" when all arrived)
    # index (in the read's items) of an item that arrived whole and failed its checksum, or
    # -1: the reader reports that block to its node (``ReportCorrupt``), which re-verifies it
    corrupt_index: int = -1


@dataclass(frozen=True)
class WriteResult:
    stored: int
    already_present: int
    in_flight: int
    checksum_failed: int
    reason: str = ""  # non-empty when the write failed as a whole (nothing stored by it)


@dataclass(frozen=True)
class LeasedBlocks:
    lease_id: int  # 0 when nothing was leased
    locations: list[tuple[int, int, int]]  # (arena offset, block bytes, checksum) of the leading present keys


@dataclass(frozen=True)
class PutSlots:
    put_id: int
    slots: list[tuple[int, int]]  # (request index, arena offset) of each block to receive
    already_present: int
    in_flight: int


class BlockStore(Protocol):
    """The node side of the data plane (implemented by ``kvpool.daemon.cluster_node``)."""

    def arena(self) -> np.ndarray: ...

    def block_bytes(self, namespace: bytes) -> int:
        """Block size of a registered namespace; raises UnknownNamespace otherwise."""
        ...

    def lease(self, namespace: bytes, keys: Sequence[bytes]) -> LeasedBlocks: ...

    def release(self, lease_id: int) -> None: ...

    def drop_corrupt(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """Re-verify blocks (hashes of ``namespace``) that the server found rotten while
        serving them and drop the ones that fail; returns how many were dropped."""
        ...

    def put_start(self, namespace: bytes, keys: Sequence[bytes]) -> PutSlots: ...

    def put_commit(self, put_id: int, checksums: Sequence[int]) -> tuple[int, int]:
        """(committed, checksum_failed)."""
        ...

    def write_slot(self, put_id: int, slot: int, data: np.ndarray) -> bool:
        """Copy one received block into ``PutSlots.slots[slot]`` of put ``put_id``, checking
        under the store lock that the put still holds that slot; False = reclaimed, nothing
        written. Received bytes never go straight into the arena, so a slow writer's late
        bytes cannot land in a slot that a newer put has reused."""
        ...

    def put_abort(self, put_id: int) -> None: ...


class TicketSource(Protocol):
    """Where a client gets its data-plane ticket for a peer (``kvpool.core.tickets``): from that
    node's control plane, over gRPC with the client's token (``kvpool.client.tickets``)."""

    def ticket(self, peer: str) -> DataTicket:
        """A live ticket for the data plane at ``peer``; raises a KVPoolError if none can be had."""
        ...

    def forget(self, peer: str) -> None:
        """``peer`` refused the ticket (it restarted, or the ticket expired): get a new one next time."""
        ...


class Transport(Protocol):
    """The reading / writing side: one object per process, connections cached per peer."""

    name: str

    def read(self, peer: str, namespace: bytes, items: Sequence[ReadItem], dst: Sequence[np.ndarray]) -> ReadResult:
        """Read items from ``peer`` into ``dst`` (one writable uint8 view per item, of the
        item's length). Returns how many leading items arrived and verified."""
        ...

    def write(self, peer: str, namespace: bytes, keys: Sequence[bytes], rows: np.ndarray) -> WriteResult:
        """Store ``rows`` ([n, block_bytes] uint8) on ``peer`` under ``keys``."""
        ...

    def learn_peer(self, peer: str, metadata: bytes) -> None:
        """Take what the directory published for ``peer`` beyond its address (a NIXL agent's
        metadata); a no-op for transports that need nothing more."""
        ...

    def use_tickets(self, tickets: TicketSource | None) -> None:
        """Prove a data-plane ticket from ``tickets`` on each new connection (None: no AUTH)."""
        ...

    def use_tls(self, root_certs: bytes | None) -> None:
        """TLS on each new connection, verified against ``root_certs`` (PEM)."""
        ...

    def close(self) -> None: ...


class DataServer(Protocol):
    address: str
    transport_metadata: bytes  # published in the node's registration record ("" for tcp / ucx)

    def start(self) -> None: ...

    def stop(self) -> None: ...
