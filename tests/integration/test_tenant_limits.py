"""Per-tenant limits on a real daemon (issue 10): a tenant's own quota from the credentials
file, and per-tenant fairness under a flood.

- A tenant with ``quota_bytes`` in the credentials file holds at most that many host-tier
  bytes over all its namespaces together; writing past it evicts only its own oldest
  blocks; another tenant (on the uniform ``--namespace-quota-bytes``) loses nothing and
  reads back every byte it stored.
- A tenant flooding the daemon with the largest requests from many threads is refused
  ``TENANT_BUSY`` (typed, RESOURCE_EXHAUSTED) past its share, while another tenant's calls
  all succeed with the right answers, and the daemon keeps serving.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import grpc
import numpy as np
from conftest import DaemonHandle
from test_auth import NS_A, NS_A2, NS_B, SPEC, TOKEN_A, TOKEN_B, TOKENS, make_blocks

from kvpool import PoolClient
from kvpool.core.auth import token_sha256
from kvpool.core.errors import ErrorCode, TenantBusy
from kvpool.daemon.cluster_local import eventually
from kvpool.daemon.service import MAX_RELEASE_IDS_PER_CALL
from kvpool.proto import pool_pb2, pool_pb2_grpc
from kvpool.rpc.errors import from_rpc_error


def test_a_tenant_quota_from_the_credentials_file_caps_all_its_namespaces(daemon_factory: Any, tmp_path: Any) -> None:
    quota_blocks = 6
    path = os.path.join(str(tmp_path), "credentials.json")
    with open(path, "w") as fh:
        json.dump(
            {
                "tenants": [
                    {
                        "name": "tenant-a",
                        "token_sha256": token_sha256(TOKEN_A),
                        "namespaces": [NS_A.hex(), NS_A2.hex()],
                        "quota_bytes": quota_blocks * SPEC.block_bytes,
                    },
                    {"name": "tenant-b", "token_sha256": token_sha256(TOKEN_B), "namespaces": [NS_B.hex()]},
                ]
            },
            fh,
        )
    daemon: DaemonHandle = daemon_factory("--credentials", path, "--namespace-quota-bytes", str(4 * SPEC.block_bytes))
    with (
        PoolClient.connect(daemon.address, SPEC, salt=b"salt-a", token=TOKEN_A) as a,
        PoolClient.connect(daemon.address, SPEC, salt=b"salt-a-second", token=TOKEN_A) as a2,
        PoolClient.connect(daemon.address, SPEC, salt=b"salt-b", token=TOKEN_B) as b,
    ):
        b_hashes = b.hashes(TOKENS)
        b_blocks = make_blocks(4, seed=30)
        assert b.put(b_hashes, b_blocks).stored == 4  # B at its uniform quota
        first = a.hashes(list(range(16 * 4)))
        assert a.put(first, make_blocks(4, seed=31)).stored == 4
        flood = a2.hashes(list(range(16 * 40)))
        for start in range(0, 40, 4):  # tenant A writes, through its second namespace, 7x its quota
            assert a2.put(flood[start : start + 4], make_blocks(4, seed=start)).stored == 4
        held_a = sum(a.lookup([h]) for h in first) + sum(a2.lookup([h]) for h in flood)
        assert held_a == quota_blocks  # both namespaces together, at the tenant's quota
        assert a2.lookup(flood[-quota_blocks:]) == quota_blocks  # it keeps its newest share
        used = [ns["used_bytes"] for c in (a, a2) for ns in c.stats()["namespaces"]]
        assert sum(used) == quota_blocks * SPEC.block_bytes
        assert b.get(b_hashes).tobytes() == b_blocks.tobytes()  # B lost nothing to A: 0 cross-tenant evictions
        assert b.stats()["namespaces"][0]["used_bytes"] == 4 * SPEC.block_bytes  # B keeps the uniform quota


def test_a_flooding_tenant_is_refused_its_excess_and_another_tenant_is_served(daemon_factory: Any) -> None:
    daemon: DaemonHandle = daemon_factory(
        "--tenant-budget-units", "16", "--tenant-rate-units-per-s", "200", "--tenant-wait-ms", "20"
    )  # fmt: skip
    codes: list[str] = []
    stop = threading.Event()
    with (
        PoolClient.connect(daemon.address, SPEC, salt=b"victim") as victim,
        PoolClient.connect(daemon.address, SPEC, salt=b"flooder") as flooder,
    ):
        hashes = victim.hashes(TOKENS)
        blocks = make_blocks(4, seed=33)
        assert victim.put(hashes, blocks).stored == 4
        rng = np.random.default_rng(5)
        big = pool_pb2.HashesRequest(
            namespace=flooder.namespace.digest(), hashes=rng.bytes(16 * flooder.max_batch_blocks)
        )
        ids = pool_pb2.ReleaseRequest(lease_ids=[int(x) for x in rng.integers(1, 2**62, MAX_RELEASE_IDS_PER_CALL)])

        def flood() -> None:
            with grpc.insecure_channel(daemon.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
                stub = pool_pb2_grpc.PoolStub(ch)
                while not stop.is_set() and len(codes) < 400:
                    for method, request in ((stub.Lookup, big), (stub.Release, ids)):
                        try:
                            method(request, timeout=30)
                            codes.append("ok")
                        except grpc.RpcError as exc:
                            codes.append(from_rpc_error(exc, daemon.address).code.wire_name)

        threads = [threading.Thread(target=flood) for _ in range(6)]
        for t in threads:
            t.start()
        try:
            for served in range(150):  # the victim's calls all succeed, with the right answers
                assert victim.lookup(hashes) == 4
                if served % 25 == 0:
                    np.testing.assert_array_equal(victim.get(hashes), blocks)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert set(codes) <= {"ok", ErrorCode.TENANT_BUSY.wire_name}  # typed, never INTERNAL
        assert codes.count(ErrorCode.TENANT_BUSY.wire_name) > 0  # the flood was held to its share
        stats = victim.stats()
        assert stats["tenant_calls_refused"] >= codes.count(ErrorCode.TENANT_BUSY.wire_name)  # counted by the daemon
        assert victim.lookup(hashes) == 4  # still serving


def test_the_blocks_a_lookup_finds_are_billed_to_its_tenant(daemon_factory: Any) -> None:
    """A lookup that hits costs its tenant the blocks it walked (``--tenant-walk-cost-items``),
    billed after the call: with a walk cost far above its rate, tenant B's second large hit
    lookup finds B in debt and is refused TENANT_BUSY having done nothing, while tenant A's
    large lookups (its own bucket) all run. With the walk cost 0 B's second one runs."""
    for walk_cost, b_refused in (("10000", True), ("0", False)):
        daemon: DaemonHandle = daemon_factory(
            "--tenant-walk-cost-items", walk_cost, "--tenant-rate-units-per-s", "100", "--tenant-wait-ms", "50"
        )
        with (
            PoolClient.connect(daemon.address, SPEC, salt=b"salt-a") as a,
            PoolClient.connect(daemon.address, SPEC, salt=b"salt-b") as b,
        ):
            blocks = make_blocks(64, seed=41)
            hashes_a, hashes_b = a.hashes(np.arange(16 * 64)), b.hashes(np.arange(16 * 64))
            assert a.put(hashes_a, blocks).stored == 64 and b.put(hashes_b, blocks).stored == 64
            # 2,048 hashes (cost 3), all hit: 2,048 x 10,000 items walked, a debt of one second of rate
            big_b = pool_pb2.HashesRequest(namespace=b.namespace.digest(), hashes=b"".join(hashes_b) * 32)
            big_a = pool_pb2.HashesRequest(namespace=a.namespace.digest(), hashes=b"".join(hashes_a) * 32)
            with grpc.insecure_channel(daemon.address) as channel:
                stub = pool_pb2_grpc.PoolStub(channel)
                assert stub.Lookup(big_b, timeout=10).hits == 2048  # the 64 blocks, 32 times over
                outcomes = []
                for _ in range(2):
                    try:
                        outcomes.append(stub.Lookup(big_b, timeout=10).hits)
                    except grpc.RpcError as exc:
                        assert from_rpc_error(exc, daemon.address).code == ErrorCode.TENANT_BUSY
                        outcomes.append(-1)
                assert (outcomes == [-1, -1]) if b_refused else (outcomes == [2048, 2048]), outcomes
                assert stub.Lookup(big_a, timeout=10).hits == 2048  # A's bucket is its own
            # small calls wait out their tenant's debt too (every call pays into the rate): typed
            # TENANT_BUSY meanwhile, then served
            for client, hashes in ((a, hashes_a), (b, hashes_b)):
                assert eventually(lambda c=client, h=hashes: small_lookup(c, h) == 64, timeout_s=30)
        daemon.stop()


def small_lookup(client: PoolClient, hashes: list[bytes]) -> int:
    """A lookup's hits, or -1 when its tenant is over its share (TENANT_BUSY)."""
    try:
        return client.lookup(hashes)
    except TenantBusy:
        return -1


def test_a_flood_of_small_hit_lookups_is_rate_limited(daemon_factory: Any) -> None:
    """Lookups of 1,023 hashes that all hit cost one unit each at admission, and their walks
    are billed after: with a per-call cost (``--tenant-call-cost-items``, on by default) a
    tenant sending them back to back runs into its rate and is refused TENANT_BUSY, while
    another tenant's lookups all run; with ``--tenant-call-cost-items 0`` (the rule before)
    one-unit calls are never rate-limited and the same 40 all run."""
    for per_call, b_limited in (("64", True), ("0", False)):
        daemon: DaemonHandle = daemon_factory(
            "--tenant-call-cost-items", per_call, "--tenant-rate-units-per-s", "20", "--tenant-wait-ms", "20"
        )
        with (
            PoolClient.connect(daemon.address, SPEC, salt=b"salt-a") as a,
            PoolClient.connect(daemon.address, SPEC, salt=b"salt-b") as b,
        ):
            hashes_a, hashes_b = a.hashes(np.arange(16 * 8)), b.hashes(np.arange(16 * 1023))
            assert a.put(hashes_a, make_blocks(8, seed=43)).stored == 8
            for i in range(0, 1023, 256):
                chunk = hashes_b[i : i + 256]
                assert b.put(chunk, make_blocks(len(chunk), seed=44)).stored == len(chunk)
            # each call walks 1,023 blocks: about 8 units billed after it, the rate is 20 a second
            outcomes = [small_lookup(b, hashes_b) for _ in range(40)]
            assert set(outcomes) <= {1023, -1}
            assert (-1 in outcomes) == b_limited, outcomes
            assert all(a.lookup(hashes_a) == 8 for _ in range(20))  # A's own bucket
        daemon.stop()
