"""Tenant B against tenant A on one real daemon (issue 10, items 1, 4 and 5).

B knows A's block hashes (as it would from a leaked log or a guess) and tries every call
on them: it must read nothing, detect nothing, pin / unpin / remove nothing and overwrite
nothing; a client with another model spec reads nothing either. Snapshot and Events are
scoped to the caller's namespace; the all-namespace views are admin views. Every list a
request carries is bounded and refused with a typed error past its limit.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import DaemonHandle

from kvpool import KVSpec, PoolClient
from kvpool.client.admin import PoolAdmin
from kvpool.client.pool_common import hello_request
from kvpool.core.errors import InvalidArgument, KVPoolError, PermissionDenied
from kvpool.core.events import KVEvent
from kvpool.core.hashing import pack_hashes
from kvpool.core.spec import MAX_MODEL_NAME_BYTES, Namespace
from kvpool.daemon.service import MAX_RELEASE_IDS_PER_CALL
from kvpool.proto import pool_pb2, pool_pb2_grpc
from kvpool.rpc.errors import from_rpc_error

SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
OTHER_MODEL = KVSpec(model="tiny-llama-2", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
TOKENS = list(range(5000, 5000 + 16 * 6))
WAIT_S = 10.0


def make_blocks(n: int, seed: int) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 2**16, size=(n, *SPEC.block_shape), dtype=np.uint16)
    return raw.view(np.float16)


def call(address: str, method: str, request: Any, timeout_s: float = 10.0) -> Any:
    with grpc.insecure_channel(address) as channel:
        return getattr(pool_pb2_grpc.PoolStub(channel), method)(request, timeout=timeout_s)


def typed_error(address: str, method: str, request: Any) -> KVPoolError:
    with pytest.raises(grpc.RpcError) as info:
        call(address, method, request)
    return from_rpc_error(info.value, address)


def stats(address: str, **fields: Any) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(call(address, "Stats", pool_pb2.StatsRequest(**fields)).json)
    return result


@pytest.fixture
def tenants(pool_daemon: DaemonHandle) -> Iterator[tuple[PoolClient, PoolClient, list[bytes], np.ndarray]]:
    """A has stored 6 blocks; B is connected with its own salt and knows A's hashes."""
    a = PoolClient.connect(pool_daemon.address, SPEC, salt=b"tenant-a")
    b = PoolClient.connect(pool_daemon.address, SPEC, salt=b"tenant-b")
    try:
        hashes = a.hashes(TOKENS)
        blocks = make_blocks(6, seed=1)
        assert a.put(hashes, blocks).stored == 6
        yield a, b, hashes, blocks
    finally:
        b.close()
        a.close()


def test_tenant_b_reads_and_detects_nothing_of_a(
    pool_daemon: DaemonHandle, tenants: tuple[PoolClient, PoolClient, list[bytes], np.ndarray]
) -> None:
    a, b, hashes, blocks = tenants
    address = pool_daemon.address
    ns_b = b.namespace.digest()
    assert b.lookup(hashes) == 0
    assert b.get(hashes).shape[0] == 0
    lease = call(address, "Lease", pool_pb2.HashesRequest(namespace=ns_b, hashes=pack_hashes(hashes)))
    assert lease.lease_id == 0 and list(lease.offsets) == []  # no arena offset of A's bytes
    start = call(address, "PutStart", pool_pb2.HashesRequest(namespace=ns_b, hashes=pack_hashes(hashes)))
    assert list(start.already_present) == [] and list(start.in_flight) == []  # present-ness not revealed
    assert list(start.indices) == list(range(6))
    call(address, "PutAbort", pool_pb2.PutAbortRequest(put_id=start.put_id))
    with PoolClient.connect(address, OTHER_MODEL, salt=b"tenant-a") as other_model:
        assert other_model.lookup(hashes) == 0
        assert other_model.get(hashes).shape[0] == 0
    assert a.get(hashes).tobytes() == blocks.tobytes()


def test_tenant_b_pins_removes_and_overwrites_nothing_of_a(
    pool_daemon: DaemonHandle, tenants: tuple[PoolClient, PoolClient, list[bytes], np.ndarray]
) -> None:
    a, b, hashes, blocks = tenants
    assert b.pin(hashes) == 0  # hard
    assert b.pin(hashes, ttl_ms=60_000) == 0  # soft
    assert a.unpin(hashes) == 0  # B's pins did not land on A's blocks
    assert a.pin(hashes[:2]) == 2
    assert b.unpin(hashes) == 0  # ...and B cannot lift A's pins
    assert a.unpin(hashes[:2]) == 2
    assert b.remove(hashes) == 0
    assert a.lookup(hashes) == 6
    # B stores its own bytes under A's hashes: they live beside A's, never instead of them
    forged = make_blocks(6, seed=2)
    assert b.put(hashes, forged).stored == 6
    assert a.get(hashes).tobytes() == blocks.tobytes()
    assert b.get(hashes).tobytes() == forged.tobytes()
    assert b.remove(hashes) == 6  # B's own blocks
    assert a.get(hashes).tobytes() == blocks.tobytes()
    assert b.lookup(hashes) == 0


def test_snapshot_and_events_are_scoped_to_the_callers_namespace(
    pool_daemon: DaemonHandle, tenants: tuple[PoolClient, PoolClient, list[bytes], np.ndarray]
) -> None:
    a, b, hashes, _ = tenants
    address = pool_daemon.address
    assert b.snapshot() == (0, [])
    seq_a, present_a = a.snapshot()
    assert seq_a == 1 and sorted(present_a) == sorted(hashes)
    seen: list[KVEvent] = []

    def follow() -> None:
        for event in b.events(from_seq=1):
            seen.append(event)
            return

    watcher = threading.Thread(target=follow, daemon=True)
    watcher.start()
    own = b.hashes(list(range(16)))
    assert b.put(own, make_blocks(1, seed=3)).stored == 1
    watcher.join(WAIT_S)
    assert not watcher.is_alive()
    # B's first event is its own put, numbered 1 in its namespace; A's STORED never reached it
    assert [(e.seq, list(e.hashes), e.namespace) for e in seen] == [(1, own, b.namespace.digest())]
    # a request naming no namespace is refused, not answered with every tenant's hashes
    err = typed_error(address, "Snapshot", pool_pb2.SnapshotRequest())
    assert isinstance(err, InvalidArgument)
    # the admin view (loopback default) sees both, with node-wide numbers
    with PoolAdmin(address) as admin:
        last_seq, every = admin.snapshot()
        assert last_seq == 2 and sorted(every) == sorted([*hashes, *own])
        assert {ns["digest"] for ns in admin.stats()["namespaces"]} == {
            a.namespace.digest().hex(),
            b.namespace.digest().hex(),
        }


def test_admin_views_are_refused_where_the_listener_does_not_serve_them(daemon_factory: Any) -> None:
    daemon: DaemonHandle = daemon_factory("--admin-views", "off")
    with PoolClient.connect(daemon.address, SPEC, salt=b"tenant-a") as a:
        a.put(a.hashes(TOKENS)[:1], make_blocks(1, seed=4))
        assert len(a.snapshot()[1]) == 1  # a tenant's own views still work
        err = typed_error(daemon.address, "Snapshot", pool_pb2.SnapshotRequest(all_namespaces=True))
        assert isinstance(err, PermissionDenied) and "security" in err.hint
        with pytest.raises(PermissionDenied):
            next(iter(PoolAdmin(daemon.address).events(from_seq=1)))
        listed = stats(daemon.address)
        assert listed["namespaces"] == [] and listed["namespaces_total"] == 1
        own = stats(daemon.address, namespace=a.namespace.digest())["namespaces"]
        assert [ns["digest"] for ns in own] == [a.namespace.digest().hex()]


def test_lists_in_requests_are_bounded_and_remove_releases_its_lease_ids(pool_daemon: DaemonHandle) -> None:
    address = pool_daemon.address
    with PoolClient.connect(address, SPEC, salt=b"tenant-a") as a:
        hashes = a.hashes(TOKENS)
        a.put(hashes, make_blocks(6, seed=5))
        ns = a.namespace.digest()
        too_many = list(range(1, MAX_RELEASE_IDS_PER_CALL + 2))
        err = typed_error(address, "Release", pool_pb2.ReleaseRequest(lease_ids=too_many))
        assert isinstance(err, InvalidArgument) and str(MAX_RELEASE_IDS_PER_CALL) in err.message
        request = pool_pb2.HashesRequest(namespace=ns, hashes=pack_hashes(hashes), release_lease_ids=too_many)
        assert isinstance(typed_error(address, "Lookup", request), InvalidArgument)
        leases = [
            call(address, "Lease", pool_pb2.HashesRequest(namespace=ns, hashes=pack_hashes(hashes))) for _ in "ab"
        ]
        assert stats(address)["leases_active"] == 2
        removed = call(
            address,
            "Remove",
            pool_pb2.HashesRequest(
                namespace=ns, hashes=pack_hashes(hashes[5:]), release_lease_ids=[x.lease_id for x in leases]
            ),
        )
        assert removed.removed == 1 and stats(address)["leases_active"] == 0
        huge_ttl = pool_pb2.PinRequest(namespace=ns, hashes=pack_hashes(hashes[:1]), ttl_ms=2**64 - 1)
        assert isinstance(typed_error(address, "Pin", huge_ttl), InvalidArgument)
        # lease ids are not a counter another caller could walk to end A's leases
        assert leases[1].lease_id - leases[0].lease_id != 1


def test_oversized_model_names_are_refused_and_the_daemon_keeps_serving(pool_daemon: DaemonHandle) -> None:
    address = pool_daemon.address
    for size in (MAX_MODEL_NAME_BYTES + 1, 1 << 20):
        request = hello_request(Namespace(SPEC, b"x"))
        request.spec.model = "m" * size
        err = typed_error(address, "Hello", request)
        assert isinstance(err, InvalidArgument) and str(MAX_MODEL_NAME_BYTES) in err.message
    assert stats(address)["namespaces_total"] == 0
    with PoolClient.connect(address, SPEC) as client:
        assert client.put(client.hashes(TOKENS)[:1], make_blocks(1, seed=6)).stored == 1


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


#: what a namespace flood may add to the daemon: a full table (4096 namespaces with the
#: longest model names) measured ~4.4 MiB after 20,000 Hellos; docs/security.md states 32 MiB
FLOOD_RSS_BOUND_BYTES = 32 << 20


def test_a_namespace_flood_locks_no_tenant_out_and_stays_within_its_memory_bound(pool_daemon: DaemonHandle) -> None:
    address = pool_daemon.address
    rng = np.random.default_rng(8)
    with PoolClient.connect(address, SPEC, salt=b"tenant-a") as a:
        hashes = a.hashes(TOKENS)
        a.put(hashes, make_blocks(6, seed=7))
        before = rss_bytes(pool_daemon.pid)
        with grpc.insecure_channel(address) as channel:
            stub = pool_pb2_grpc.PoolStub(channel)
            for i in range(5000):  # more than the table holds (4096), each with a longest model name
                spec = KVSpec("m" * (MAX_MODEL_NAME_BYTES - 8) + f"{i:08d}", 2, 2, 64, "float16", 16)
                request = hello_request(Namespace(spec, rng.bytes(16)))
                stub.Hello(request, timeout=10)
            grown = rss_bytes(pool_daemon.pid) - before
            assert grown < FLOOD_RSS_BOUND_BYTES, f"the flood grew the daemon by {grown} bytes"
            listed = json.loads(stub.Stats(pool_pb2.StatsRequest(), timeout=10).json)
            assert listed["namespaces_total"] <= 4096 and listed["namespaces_retired"] >= 5000 + 1 - 4096
            assert len(listed["namespaces"]) <= 256  # one bounded page
            # A holds blocks: it was never retired (no Hello needed for this raw call)
            lookup = pool_pb2.HashesRequest(namespace=a.namespace.digest(), hashes=pack_hashes(hashes))
            assert stub.Lookup(lookup, timeout=10).hits == 6
        # and a tenant arriving after the flood gets in
        with PoolClient.connect(address, SPEC, salt=b"tenant-late") as late:
            assert late.put(late.hashes(TOKENS)[:1], make_blocks(1, seed=9)).stored == 1
        # a 30 MiB model name is refused before it is decoded into a spec
        huge = hello_request(Namespace(SPEC, b"huge"))
        huge.spec.model = "m" * (30 << 20)
        assert isinstance(typed_error(address, "Hello", huge), InvalidArgument)
        assert stats(address)["namespaces_total"] <= 4096


def test_a_tenant_over_its_quota_evicts_its_own_blocks_not_anothers(daemon_factory: Any) -> None:
    daemon: DaemonHandle = daemon_factory("--namespace-quota-bytes", str(4 * SPEC.block_bytes))
    with (
        PoolClient.connect(daemon.address, SPEC, salt=b"tenant-a") as a,
        PoolClient.connect(daemon.address, SPEC, salt=b"tenant-b") as b,
    ):
        mine = a.hashes(TOKENS)[:4]
        blocks = make_blocks(4, seed=10)
        assert a.put(mine, blocks).stored == 4
        flood = b.hashes(list(range(16 * 40)))
        for start in range(0, 40, 4):  # B writes ten times its quota
            assert b.put(flood[start : start + 4], make_blocks(4, seed=start)).stored == 4
        assert b.lookup(flood[36:]) == 4 and b.lookup(flood) == 0  # B keeps only its newest share
        assert a.get(mine).tobytes() == blocks.tobytes()  # A lost nothing to B
        own = {ns["digest"]: ns["used_bytes"] for ns in a.stats()["namespaces"]}
        assert own[a.namespace.digest().hex()] == own[b.namespace.digest().hex()] == 4 * SPEC.block_bytes
