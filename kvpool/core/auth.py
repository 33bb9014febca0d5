"""Credentials: who may call a daemon, and which namespaces each caller may use.

A credentials file (JSON, or TOML when its name ends in ``.toml``) lists principals by
the SHA-256 of their bearer token, never the token itself, so a leaked file does not
leak a token:

    [[tenants]]
    name = "tenant-a"
    token_sha256 = "<64 hex>"
    namespaces = ["<32 hex: a namespace digest>", ...]
    quota_bytes = 8589934592    # optional: host-tier bytes of all its namespaces together

    [[admins]]
    name = "ops"
    token_sha256 = "<64 hex>"

    [cluster]
    token_sha256 = "<64 hex>"   # what nodes present to the directory and to each other

Why namespace digests and not salts: the salt never leaves the client (the daemon sees
only ``Namespace.digest()``), so the digest is the one name of a namespace the daemon can
check. A tenant's token authorises exactly the digests listed for it; a call naming any
other digest is ``PERMISSION_DENIED`` (whose message names the digest to add). The
digest is not a secret; the token is.

Tokens are compared as ``hmac.compare_digest(sha256(presented), stored)`` against every
entry, without stopping at the first match, so the time taken does not depend on how
many leading bytes of a stored hash the presented token matches. Every size is bounded
(``MAX_*``) because the file and the presented tokens come from outside the process.
This module is stdlib only; reading the file is the composition root's job.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import tomllib
from dataclasses import dataclass
from typing import Any

from kvpool.core.errors import InvalidArgument
from kvpool.core.keys import NAMESPACE_BYTES
from kvpool.core.tickets import CLUSTER_INDEX, TicketIssuer

#: largest credentials file accepted, in bytes
MAX_CREDENTIALS_FILE_BYTES = 4 << 20
#: most principals (tenants + admins) in one file
MAX_PRINCIPALS = 1024  # each call compares the token with every entry
#: most namespace digests one tenant may list
MAX_NAMESPACES_PER_TENANT = 4096
#: longest principal name, in bytes
MAX_NAME_BYTES = 128
#: longest bearer token a caller may present, in bytes (longer ones are refused unhashed)
MAX_TOKEN_BYTES = 512
#: largest quota_bytes a tenant may be given (1 EiB: a sanity bound on an integer from a file)
MAX_QUOTA_BYTES = 1 << 60
#: shortest token ``new_token`` makes, in random bytes
TOKEN_RANDOM_BYTES = 32

SHA256_HEX_CHARS = 64


def token_sha256(token: str) -> str:
    """The hex SHA-256 of a token: what the credentials file stores."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh random bearer token (URL-safe text, 256 bits)."""
    import secrets

    return "kvp_" + secrets.token_urlsafe(TOKEN_RANDOM_BYTES)


@dataclass(frozen=True)
class Principal:
    """An authenticated caller. ``namespaces`` None = every namespace (admins and the
    unauthenticated loopback default); ``admin`` = may use the admin views and calls."""

    name: str
    admin: bool
    namespaces: frozenset[bytes] | None
    cluster: bool = False  # a node of the cluster (presented the cluster token)
    quota_bytes: int = 0  # a tenant's own quota over all its namespaces; 0 = the daemon's per-namespace one

    def may_use(self, namespace: bytes) -> bool:
        return self.namespaces is None or namespace in self.namespaces


#: the caller when a daemon runs without credentials (the loopback embedded default)
ANONYMOUS = Principal("anonymous", admin=True, namespaces=None, cluster=True)
#: whoever presented the cluster token
CLUSTER = Principal("cluster", admin=False, namespaces=None, cluster=True)


@dataclass(frozen=True)
class ArenaOwners:
    """The owners of a per-tenant arena's segments (``Credentials.arena_owners``)."""

    namespace_owner: dict[bytes, int]  # namespace -> owner; a namespace not listed: owner 0

    def owners_of(self, principal: Principal) -> frozenset[int] | None:
        """The owners whose segments ``principal`` may map: those of its namespaces; None
        (every segment) for admins, the cluster and the anonymous caller, who may use every
        namespace anyway."""
        if principal.namespaces is None:
            return None
        return frozenset(self.namespace_owner.get(ns, 0) for ns in principal.namespaces)


@dataclass(frozen=True)
class _Entry:
    digest: bytes  # sha256 of the token, 32 bytes
    principal: Principal


@dataclass(frozen=True)
class Credentials:
    """The parsed credentials file. ``identify`` is the only way to get a Principal."""

    entries: tuple[_Entry, ...]
    cluster_digest: bytes = b""  # sha256 of the cluster token; b"" = none configured
    #: the daemon's data-plane ticket issuer (``with_tickets``, at start); None = no data plane admits anyone
    tickets: TicketIssuer | None = None

    def with_tickets(self, issuer: TicketIssuer) -> Credentials:
        """These credentials, issuing and checking data-plane tickets with ``issuer``."""
        return Credentials(self.entries, self.cluster_digest, issuer)

    def identify(self, token: str) -> Principal | None:
        """The principal whose token this is, or None. Constant-time per entry, and every
        entry is compared (no early exit)."""
        raw = token.encode()
        if not raw or len(raw) > MAX_TOKEN_BYTES:
            return None
        presented = hashlib.sha256(raw).digest()
        found: Principal | None = None
        for entry in self.entries:
            if hmac.compare_digest(presented, entry.digest):
                found = entry.principal
        if self.cluster_digest and hmac.compare_digest(presented, self.cluster_digest):
            found = CLUSTER
        return found

    def tenant_quotas(self) -> dict[bytes, tuple[str, int]]:
        """namespace -> (tenant, quota bytes) for every namespace of a tenant with its own
        ``quota_bytes`` (the store counts those namespaces together against it)."""
        return {
            ns: (e.principal.name, e.principal.quota_bytes)
            for e in self.entries
            if e.principal.quota_bytes and e.principal.namespaces
            for ns in e.principal.namespaces
        }

    def arena_owners(self) -> ArenaOwners:
        """Who owns which segments of a per-tenant arena (docs/security.md): the namespaces
        listed by exactly the same tenants form one owner (1, 2, ... in a stable order), so
        a segment holds only blocks that every tenant who can map it may read anyway;
        namespaces no tenant lists (only admins reach them) are owner 0."""
        listed_by: dict[bytes, set[str]] = {}
        for entry in self.entries:
            if entry.principal.namespaces is not None:
                for ns in entry.principal.namespaces:
                    listed_by.setdefault(ns, set()).add(entry.principal.name)
        groups = sorted({tuple(sorted(names)) for names in listed_by.values()})
        number = {group: i + 1 for i, group in enumerate(groups)}
        return ArenaOwners({ns: number[tuple(sorted(names))] for ns, names in listed_by.items()})

    def cluster_token_ok(self, token: bytes) -> bool:
        """Whether ``token`` is the cluster token."""
        if not self.cluster_digest or not token or len(token) > MAX_TOKEN_BYTES:
            return False
        return hmac.compare_digest(hashlib.sha256(token).digest(), self.cluster_digest)

    def issue_ticket(self, principal: Principal, now_ms: int) -> tuple[bytes, bytes] | None:
        """(ticket id, ticket key) admitting ``principal`` (one ``identify`` returned) to the data
        plane until ``now_ms`` + the issuer's TTL, or None without an issuer."""
        if self.tickets is None:
            return None
        if principal == CLUSTER:
            return self.tickets.issue(CLUSTER_INDEX, now_ms)
        index = next((i for i, e in enumerate(self.entries) if e.principal == principal), None)
        return None if index is None else self.tickets.issue(index, now_ms)

    def identify_ticket(self, ticket_id: bytes, nonce: bytes, proof: bytes, now_ms: int) -> Principal | None:
        """The principal of a live ticket whose key made ``proof`` for ``nonce``, or None
        (``kvpool.core.tickets``: the token hashes of this file are no data-plane key)."""
        if self.tickets is None:
            return None
        index = self.tickets.check(ticket_id, nonce, proof, now_ms)
        if index == CLUSTER_INDEX and self.cluster_digest:
            return CLUSTER
        if index is None or index >= len(self.entries):
            return None
        return self.entries[index].principal


def _hex_digest(value: Any, where: str, chars: int) -> bytes:
    if not isinstance(value, str) or len(value) != chars:
        raise InvalidArgument(f"{where}: expected {chars} hex characters, got {str(value)[:80]!r}")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise InvalidArgument(f"{where}: {value[:80]!r} is not hex") from None


def _name(item: dict[str, Any], where: str) -> str:
    name = item.get("name", "")
    if not isinstance(name, str) or not name or len(name.encode()) > MAX_NAME_BYTES:
        raise InvalidArgument(f"{where}: 'name' must be a non-empty string of at most {MAX_NAME_BYTES} bytes")
    return name


def parse_credentials(text: bytes, toml: bool = False) -> Credentials:
    """Parse a credentials file's bytes (JSON, or TOML if ``toml``); InvalidArgument with
    the offending entry on any error."""
    if len(text) > MAX_CREDENTIALS_FILE_BYTES:
        raise InvalidArgument(f"credentials file is {len(text)} bytes; the limit is {MAX_CREDENTIALS_FILE_BYTES}")
    try:
        table: Any = tomllib.loads(text.decode()) if toml else json.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise InvalidArgument(f"credentials file does not parse: {exc}") from None
    if not isinstance(table, dict):
        raise InvalidArgument("credentials file must be a table / object at top level")
    unknown = set(table) - {"tenants", "admins", "cluster"}
    if unknown:
        raise InvalidArgument(
            f"unknown keys {sorted(unknown)} in the credentials file", hint="tenants, admins, cluster"
        )
    tenants, admins = table.get("tenants", []), table.get("admins", [])
    if not isinstance(tenants, list) or not isinstance(admins, list):
        raise InvalidArgument("'tenants' and 'admins' must be lists of tables")
    if len(tenants) + len(admins) > MAX_PRINCIPALS:
        raise InvalidArgument(f"{len(tenants) + len(admins)} principals; the limit is {MAX_PRINCIPALS}")
    entries: list[_Entry] = []
    seen: set[bytes] = set()
    quota_owned: dict[bytes, str] = {}  # namespace -> the tenant with a quota that lists it
    for kind, items in (("tenants", tenants), ("admins", admins)):
        for i, item in enumerate(items):
            where = f"{kind}[{i}]"
            if not isinstance(item, dict):
                raise InvalidArgument(f"{where} is not a table")
            name = _name(item, where)
            digest = _hex_digest(item.get("token_sha256"), f"{where}.token_sha256", SHA256_HEX_CHARS)
            if digest in seen:
                raise InvalidArgument(f"{where}: this token_sha256 is listed twice", hint="give each principal its own")
            seen.add(digest)
            if kind == "admins":
                entries.append(_Entry(digest, Principal(name, admin=True, namespaces=None)))
                continue
            listed = item.get("namespaces", [])
            if not isinstance(listed, list) or len(listed) > MAX_NAMESPACES_PER_TENANT:
                raise InvalidArgument(
                    f"{where}.namespaces must be a list of at most {MAX_NAMESPACES_PER_TENANT} namespace digests"
                )
            namespaces = frozenset(
                _hex_digest(ns, f"{where}.namespaces[{j}]", 2 * NAMESPACE_BYTES) for j, ns in enumerate(listed)
            )
            quota = item.get("quota_bytes", 0)
            if not isinstance(quota, int) or isinstance(quota, bool) or not 0 <= quota <= MAX_QUOTA_BYTES:
                raise InvalidArgument(f"{where}.quota_bytes must be a whole number of bytes, 0 to {MAX_QUOTA_BYTES}")
            if quota:
                for ns in namespaces & quota_owned.keys():
                    raise InvalidArgument(
                        f"{where}: namespace {ns.hex()} is also listed by {quota_owned[ns]!r}, and both have "
                        "quota_bytes: a namespace's bytes can count against one tenant's quota only",
                        hint="list it under one of them, or drop one quota",
                    )
                quota_owned.update(dict.fromkeys(namespaces, name))
            entries.append(_Entry(digest, Principal(name, admin=False, namespaces=namespaces, quota_bytes=quota)))
    cluster = table.get("cluster", {})
    if not isinstance(cluster, dict) or set(cluster) - {"token_sha256"}:
        raise InvalidArgument("'cluster' must be a table with one key, token_sha256")
    cluster_digest = b""
    if "token_sha256" in cluster:
        cluster_digest = _hex_digest(cluster["token_sha256"], "cluster.token_sha256", SHA256_HEX_CHARS)
        if cluster_digest in seen:
            raise InvalidArgument("cluster.token_sha256 is also a tenant's or admin's", hint="use its own token")
    if not entries and not cluster_digest:
        raise InvalidArgument("the credentials file lists no tenant, admin or cluster token")
    return Credentials(tuple(entries), cluster_digest)


def bearer_token(value: str) -> str:
    """The token of an ``authorization`` metadata value ("Bearer <token>"), or ""."""
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
