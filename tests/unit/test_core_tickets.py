"""Data-plane tickets (``kvpool.core.tickets``) and directory leases per tenant.

A ticket admits only with the key its issuer derived for that exact id, for the nonce it
was proved for, before its expiry, on the issuer that made it; any other byte string is
refused. The directory's lease ids are random and a Release only drops leases of the
caller's namespaces."""

from __future__ import annotations

import json
import random

import hypothesis.strategies as st
from hypothesis import given, settings

from kvpool.core.auth import CLUSTER, parse_credentials, token_sha256
from kvpool.core.tickets import CLUSTER_INDEX, TicketIssuer, new_secret, ticket_proof
from kvpool.directory.leases import LeaseTable

SECRET = bytes(range(32))
NONCE = b"n" * 32


def flip(data: bytes, bit: int) -> bytes:
    i = bit % (8 * len(data))
    out = bytearray(data)
    out[i // 8] ^= 1 << (i % 8)
    return bytes(out)


@settings(max_examples=200, deadline=None)
@given(index=st.integers(0, CLUSTER_INDEX), now_ms=st.integers(0, 2**40), bit=st.integers(0, 10_000))
def test_a_ticket_checks_only_as_issued(index: int, now_ms: int, bit: int) -> None:
    issuer = TicketIssuer(SECRET, ttl_ms=1000)
    ticket_id, key = issuer.issue(index, now_ms)
    proof = ticket_proof(key, NONCE)
    assert issuer.check(ticket_id, NONCE, proof, now_ms) == index
    assert issuer.check(ticket_id, NONCE, proof, now_ms + 999) == index
    assert issuer.check(ticket_id, NONCE, proof, now_ms + 1000) is None  # expired
    assert issuer.check(flip(ticket_id, bit), NONCE, proof, now_ms) is None  # another index, expiry, ...
    assert issuer.check(ticket_id, flip(NONCE, bit), proof, now_ms) is None  # a replay for another nonce
    assert issuer.check(ticket_id, NONCE, flip(proof, bit), now_ms) is None
    assert issuer.check(ticket_id, NONCE, ticket_proof(flip(key, bit), NONCE), now_ms) is None
    assert TicketIssuer(new_secret()).check(ticket_id, NONCE, proof, now_ms) is None  # another node
    assert issuer.check(ticket_id[:-1], NONCE, proof, now_ms) is None


def test_credentials_map_a_ticket_to_its_principal_and_the_token_hash_is_no_key() -> None:
    text = json.dumps(
        {
            "tenants": [{"name": "a", "token_sha256": token_sha256("ta"), "namespaces": ["11" * 16]}],
            "admins": [{"name": "ops", "token_sha256": token_sha256("tops")}],
            "cluster": {"token_sha256": token_sha256("tc")},
        }
    )
    plain = parse_credentials(text.encode())
    assert plain.issue_ticket(plain.entries[0].principal, 0) is None  # no issuer: nobody is admitted
    creds = plain.with_tickets(TicketIssuer(SECRET))
    for token in ("ta", "tops", "tc"):
        principal = creds.identify(token)
        assert principal is not None
        issued = creds.issue_ticket(principal, 5)
        assert issued is not None
        ticket_id, key = issued
        assert creds.identify_ticket(ticket_id, NONCE, ticket_proof(key, NONCE), 6) == principal
        # the credentials file's hash of the same token makes no proof
        digest = bytes.fromhex(token_sha256(token))
        assert creds.identify_ticket(ticket_id, NONCE, ticket_proof(digest, NONCE), 6) is None
    assert creds.identify("tc") == CLUSTER


@settings(max_examples=50, deadline=None)
@given(grants=st.lists(st.tuples(st.sampled_from([b"A" * 16, b"B" * 16]), st.integers(1, 4)), min_size=1, max_size=20))
def test_directory_leases_are_random_and_released_only_by_their_namespace(grants: list[tuple[bytes, int]]) -> None:
    seeded = random.Random(0)
    table = LeaseTable(max_lease_ms=10_000, random_id=lambda: seeded.getrandbits(63))
    ids = {}
    for i, (namespace, n) in enumerate(grants):
        keys = [namespace + i.to_bytes(8, "big") + j.to_bytes(8, "big") for j in range(n)]
        lease_id = table.grant(keys, 5_000, 0.0)
        assert lease_id > 0
        ids[lease_id] = namespace
    assert len(ids) == len(grants)
    b_ids = [i for i, ns in ids.items() if ns == b"B" * 16]
    a_ids = [i for i, ns in ids.items() if ns == b"A" * 16]
    # B names every id, A's too: only its own go
    assert table.release(list(ids), lambda ns: ns == b"B" * 16) == len(b_ids)
    assert len(table) == len(a_ids)
    assert table.release(a_ids, lambda ns: ns == b"A" * 16) == len(a_ids)
    assert len(table) == 0 and not any(table.is_leased(k) for k in [b"A" * 32])
