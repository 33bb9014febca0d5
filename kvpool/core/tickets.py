"""Data-plane tickets: a data-plane connection is admitted only after the control plane
authenticated its caller.

A node's control plane (``Hello``, over gRPC with the caller's bearer token, TLS when
configured) hands every authenticated caller a **ticket**: an opaque id naming the
caller's principal and an expiry, and a 32-byte **ticket key** that only the node can
compute from the id (``HMAC(node secret, id)``). The node secret is 32 random bytes made
at start and never leaves the daemon, so:

- the data plane's AUTH takes a ticket id and a proof ``HMAC(ticket key, context || nonce)``
  for a fresh server nonce. Neither the bearer token nor the ticket key crosses the (maybe
  plaintext) data plane; a proof seen on the wire is good for that one nonce only;
- nothing in a file is a data-plane key: the credentials file's token hashes do not pass
  AUTH (they did before tickets), and a process that did not get a ticket from the control
  plane (with a token) cannot make one;
- a ticket is good until its expiry (``ticket_ttl_ms``) on the node that issued it, and on
  no node after that node restarts (a new secret). A connection admitted stays admitted
  while it lives; new connections need a live ticket (clients refresh at half its life).

Ticket id layout (``TICKET_VERSION`` 1), at most ``MAX_TICKET_ID_BYTES``:
``version u8 | principal index u16 (0xFFFF = the cluster token) | expires_ms u64 (the
node's monotonic clock) | 8 random bytes``. The index is into the node's own credentials
entries, which is why a ticket is valid only on its issuer. Stdlib only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

TICKET_VERSION = 1
_ID = struct.Struct("<BHQ8s")
MAX_TICKET_ID_BYTES = _ID.size  # 19
TICKET_KEY_BYTES = 32
PROOF_BYTES = 32
NONCE_BYTES = 32
SECRET_BYTES = 32
CLUSTER_INDEX = 0xFFFF
#: how long a ticket admits new data-plane connections (default)
DEFAULT_TICKET_TTL_MS = 600_000
#: the longest ticket a node issues (a sanity bound on the configured TTL)
MAX_TICKET_TTL_MS = 86_400_000
_KEY_CONTEXT = b"kvpool-data-ticket-v1|"
_PROOF_CONTEXT = b"kvpool-data-auth-v2|"


@dataclass(frozen=True)
class DataTicket:
    """What a client holds for one node: ``ticket_id`` (sent in AUTH), ``key`` (never
    sent: it keys the proof), and when to stop using it (``expires_at_s``, the client's
    ``time.monotonic()``)."""

    ticket_id: bytes
    key: bytes = b""
    expires_at_s: float = 0.0

    def __repr__(self) -> str:  # the key stays out of logs
        return f"DataTicket(id={self.ticket_id.hex()[:12]}..., expires_at_s={self.expires_at_s:.0f})"


def ticket_proof(key: bytes, nonce: bytes) -> bytes:
    """The AUTH proof for the server's ``nonce``: HMAC-SHA256 keyed by the ticket key."""
    return hmac.new(key, _PROOF_CONTEXT + nonce, hashlib.sha256).digest()


@dataclass(frozen=True)
class TicketIssuer:
    """Issues and checks one node's tickets. ``secret`` is the node's (``new_secret``)."""

    secret: bytes
    ttl_ms: int = DEFAULT_TICKET_TTL_MS

    def __post_init__(self) -> None:
        if len(self.secret) != SECRET_BYTES:
            raise ValueError(f"a ticket secret is {SECRET_BYTES} bytes")
        if not 0 < self.ttl_ms <= MAX_TICKET_TTL_MS:
            raise ValueError(f"ticket ttl_ms must be in (0, {MAX_TICKET_TTL_MS}]")

    def _key(self, ticket_id: bytes) -> bytes:
        return hmac.new(self.secret, _KEY_CONTEXT + ticket_id, hashlib.sha256).digest()

    def issue(self, index: int, now_ms: int) -> tuple[bytes, bytes]:
        """(ticket id, ticket key) for principal ``index`` (``CLUSTER_INDEX``: the cluster token)."""
        if not 0 <= index <= CLUSTER_INDEX:
            raise ValueError(f"principal index {index} out of range")
        ticket_id = _ID.pack(TICKET_VERSION, index, now_ms + self.ttl_ms, os.urandom(8))
        return ticket_id, self._key(ticket_id)

    def check(self, ticket_id: bytes, nonce: bytes, proof: bytes, now_ms: int) -> int | None:
        """The principal index of a ticket whose key made ``proof`` for ``nonce`` and that has
        not expired, or None. The proof is compared in constant time."""
        if len(ticket_id) != _ID.size or len(nonce) != NONCE_BYTES or len(proof) != PROOF_BYTES:
            return None
        version, index, expires_ms, _ = _ID.unpack(ticket_id)
        expected = ticket_proof(self._key(ticket_id), nonce)
        if not hmac.compare_digest(expected, proof) or version != TICKET_VERSION or now_ms >= expires_ms:
            return None
        return int(index)


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)
