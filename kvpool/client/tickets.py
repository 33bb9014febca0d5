"""A client's data-plane tickets (``kvpool.core.tickets``): one per node, got from that
node's control plane with the client's token, proved on every new data-plane connection.

``NodeTickets`` (what ``ClusterClient`` uses) knows each node's control address by its data
address (``learn``), asks it with a ``Hello`` when it has no live ticket for it, keeps the
ticket until half its life is gone (so a connection made near the end still has time), and
forgets it when the node refuses it (the node restarted: its secret is new). A node without
credentials issues none: it admits every connection, and the client proves an empty ticket
it does not check. At most ``MAX_NODES`` nodes are remembered (the oldest go first).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kvpool.core.errors import Unauthenticated
from kvpool.core.tickets import MAX_TICKET_ID_BYTES, DataTicket
from kvpool.proto import pool_pb2

#: nodes whose address and ticket a client remembers
MAX_NODES = 4096
#: what a client proves to a node that issues no tickets (no credentials): it checks nothing
NO_TICKET = DataTicket(bytes(MAX_TICKET_ID_BYTES))


def ticket_of(reply: pool_pb2.HelloReply, now_s: float) -> DataTicket:
    """The ticket a Hello reply carries, to be used until half its TTL has passed, or
    ``NO_TICKET`` from a node without credentials."""
    if not reply.data_ticket:
        return NO_TICKET
    return DataTicket(bytes(reply.data_ticket), bytes(reply.data_ticket_key), now_s + reply.data_ticket_ttl_ms / 2000)


class StaticTickets:
    """One ticket for every peer (a client of one node, or a test); ``forget`` keeps it."""

    def __init__(self, ticket: DataTicket) -> None:
        self._ticket = ticket

    def ticket(self, peer: str) -> DataTicket:
        return self._ticket

    def forget(self, peer: str) -> None:
        """Nothing to refresh from."""


class NodeTickets:
    """Tickets per node, got by ``hello(control_address)`` (a Hello with the client's token)."""

    def __init__(
        self, hello: Callable[[str], pool_pb2.HelloReply], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._hello = hello
        self._clock = clock
        self._control: OrderedDict[str, str] = OrderedDict()  # data address -> control address
        self._tickets: dict[str, DataTicket] = {}
        self._lock = threading.Lock()

    def learn(self, data_address: str, control_address: str) -> None:
        """Where to ask for the ticket of the data plane at ``data_address``."""
        with self._lock:
            if self._control.get(data_address) != control_address:
                self._tickets.pop(data_address, None)
            self._control[data_address] = control_address
            self._control.move_to_end(data_address)
            while len(self._control) > MAX_NODES:
                old, _ = self._control.popitem(last=False)
                self._tickets.pop(old, None)

    def store(self, data_address: str, reply: pool_pb2.HelloReply) -> None:
        """Keep the ticket of a Hello the client made anyway (a put target's)."""
        with self._lock:
            if data_address in self._control:
                self._tickets[data_address] = ticket_of(reply, self._clock())

    def ticket(self, peer: str) -> DataTicket:
        with self._lock:
            held = self._tickets.get(peer)
            control = self._control.get(peer)
        if held is not None and (held is NO_TICKET or held.expires_at_s > self._clock()):
            return held
        if control is None:
            raise Unauthenticated(
                f"no control address known for the data plane at {peer}: cannot get a ticket",
                hint="read through ClusterClient, which learns nodes from the directory",
            )
        fresh = ticket_of(self._hello(control), self._clock())  # KVPoolError if the node refuses the token
        with self._lock:
            if peer in self._control:
                self._tickets[peer] = fresh
        return fresh

    def forget(self, peer: str) -> None:
        with self._lock:
            self._tickets.pop(peer, None)
