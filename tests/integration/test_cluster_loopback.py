"""A real cluster on loopback: etcd + directory + 3 node daemons as processes.

Each node gets its own host name (--host-name), so clients treat the others as remote
and blocks cross the data plane (TCP, UCX or NIXL) exactly as between machines. The last test is tenant B
against tenant A across the cluster (issue 10).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from conftest import writable_arena

from kvpool.client.cluster_client import ClusterClient, DirectoryFailover
from kvpool.core.errors import NotFound
from kvpool.core.hashing import pack_hashes
from kvpool.core.spec import KVSpec
from kvpool.daemon.cluster_events import decode_batch
from kvpool.daemon.cluster_local import LocalCluster, etcd_binary, eventually, free_port
from kvpool.proto import directory_pb2, directory_pb2_grpc
from kvpool.transport.factory import nixl_available, ucx_available

pytestmark = [
    pytest.mark.etcd,
    pytest.mark.skipif(etcd_binary() is None, reason="etcd binary not installed (apt-get install etcd-server)"),
]

SPEC = KVSpec(model="tiny", num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 15, size=(n, *SPEC.block_shape)).astype(np.float16)


@pytest.fixture
def cluster(tmp_path) -> Iterator[LocalCluster]:  # type: ignore[no-untyped-def]
    with LocalCluster(str(tmp_path)) as c:
        c.start_etcd()
        yield c


def start_three(
    c: LocalCluster, directories: list[str], transport: str = "tcp", extra_a: list[str] | None = None
) -> list[str]:
    return [
        c.start_node(name, directories, transport=transport, extra=(extra_a or []) if name == "node-a" else []).address
        for name in ("node-a", "node-b", "node-c")
    ]


def client(c: LocalCluster, directories: list[str], local: str, **kw: object) -> ClusterClient:
    return ClusterClient.connect(SPEC, salt=b"t", directory=directories, local=local, timeout_s=3.0, **kw)  # type: ignore[arg-type]


TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.ucx), pytest.param("nixl", marks=pytest.mark.nixl)]


def skip_unusable(transport: str) -> None:
    if transport == "ucx" and ucx_available():
        pytest.skip(f"ucxx unusable: {ucx_available()}")
    if transport == "nixl" and nixl_available():
        pytest.skip(f"nixl unusable: {nixl_available()}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_put_through_a_read_from_c_across_the_data_plane(cluster: LocalCluster, transport: str) -> None:
    skip_unusable(transport)
    zmq = pytest.importorskip("zmq")
    events_port = free_port()
    d = cluster.start_directory()
    a, _, c_addr = start_three(
        cluster, [d.address], transport, ["--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}"]
    )
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"tcp://127.0.0.1:{events_port}")
    with (
        client(cluster, [d.address], a) as ca,
        client(cluster, [d.address], c_addr, replicate_after=2, transport=transport) as cc,
    ):
        # PUB/SUB drops what is published before the subscription reaches the publisher: put
        # fresh one-block probes until one is heard (the condition, not a guessed sleep)
        last_seq = -1
        for probe in range(100):
            ca.put(ca.hashes(np.arange(16) + 100_000 + 16 * probe), blocks(1, 100 + probe))
            if sub.poll(100):
                while sub.poll(200):  # the probes' batches still on their way
                    last_seq = int.from_bytes(sub.recv_multipart()[1], "big")
                break
        assert last_seq >= 0, "the subscription never reached node-a's publisher"
        h = ca.hashes(np.arange(16 * 24))
        data = blocks(24, 1)
        assert ca.put(h, data).stored == 24
        # node-a announced them in vLLM's wire format, in batches numbered on from the probes'
        seen: list[bytes] = []
        while len(seen) < 24:
            _topic, seq, payload = sub.recv_multipart()
            assert int.from_bytes(seq, "big") == last_seq + 1
            last_seq += 1
            for event in decode_batch(payload)[1]:
                if event[0] == "BlockStored":
                    assert event[4] == SPEC.block_tokens and event[6] == "CPU"
                    seen.extend(event[1])
        assert seen == h
        assert eventually(lambda: cc.lookup(h) == 24)
        holders, _ = cc.locate(h)
        assert {x.node_id for hs in holders for x in hs} == {"node-a"}  # local-first placement
        out = np.zeros_like(data)
        assert cc.get_into(h, out) == 24
        np.testing.assert_array_equal(out, data)
        assert cc.counters["remote_blocks"] == 24 and cc.counters["local_blocks"] == 0
        assert cc.transport.name == transport
        if transport == "nixl":  # pulled by NIXL READ, with node-a's agent metadata from the directory
            nixl_counters = cc.transport.counters  # type: ignore[attr-defined]
            assert nixl_counters["nixl_reads"] >= 1 and nixl_counters["tcp_peers"] == 0
            assert nixl_counters["metadata_from_directory"] == 1 and nixl_counters["metadata_from_peer"] == 0
        # one layer range of every block: only those bytes cross the wire
        layers = np.zeros((24, 2, *SPEC.block_shape[1:]), dtype=SPEC.numpy_dtype)
        assert cc.get_layers_into(h, 1, 2, layers) == 24
        np.testing.assert_array_equal(layers, data[:, 1:3])
        # a longer prompt: the lookup stops at the first block nobody holds
        longer = ca.hashes(np.arange(16 * 30))
        assert cc.lookup(longer) == 24
        # the second remote read makes the blocks hot: they are copied to node-c
        assert cc.get_into(h, out) == 24
        assert cc.counters["replicated_blocks"] == 24
        assert eventually(lambda: {x.node_id for x in cc.locate(h)[0][0]} == {"node-a", "node-c"})
        cc.counters["local_blocks"] = 0
        assert cc.get_into(h, out) == 24 and cc.counters["local_blocks"] == 24
        np.testing.assert_array_equal(out, data)
        # layer reads of local blocks come through shared memory
        one_layer = np.zeros((24, 1, *SPEC.block_shape[1:]), dtype=SPEC.numpy_dtype)
        assert cc.get_layers_into(h, 3, 1, one_layer) == 24
        np.testing.assert_array_equal(one_layer[:, 0], data[:, 3])
        # removes through the directory reach every holder
        assert cc.remove(h[:4]) == 8
        assert eventually(lambda: cc.lookup(h) == 0)
    sub.close(0)


@pytest.mark.parametrize("transport", ["tcp", pytest.param("nixl", marks=pytest.mark.nixl)])
def test_sigkill_node_lookups_stop_offering_it_and_it_rejoins(cluster: LocalCluster, transport: str) -> None:
    skip_unusable(transport)
    d = cluster.start_directory(node_ttl_ms=30_000)  # only etcd's lease can notice the death quickly
    a, _b, c_addr = start_three(cluster, [d.address], transport)
    with (
        client(cluster, [d.address], a) as ca,
        client(cluster, [d.address], c_addr, transport=transport) as cc,
    ):
        h = ca.hashes(np.arange(16 * 64))
        data = blocks(64, 2)
        assert ca.put(h, data).stored == 64
        assert eventually(lambda: cc.lookup(h) == 64)
        # a reader keeps reading while node-a is killed: every read returns a verified prefix
        # (no exception, no wrong byte), the ones in flight at the kill become partial or misses
        results: list[int] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def reader() -> None:
            buf = np.zeros_like(data)
            while not stop.is_set():
                try:
                    got = cc.get_into(h, buf)
                    np.testing.assert_array_equal(buf[:got], data[:got])
                    results.append(got)
                except BaseException as exc:  # recorded: the assertion below reports it
                    errors.append(exc)
                    return

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        assert eventually(lambda: len(results) >= 2)
        next(p for p in cluster.procs if p.name == "node-a").kill()
        assert eventually(lambda: len(results) >= 3 and results[-1] == 0)
        stop.set()
        thread.join(10)
        assert not errors, errors
        assert results[0] == 64 and results[-1] == 0
        if transport == "nixl":
            assert cc.transport.counters["nixl_reads"] >= 2  # type: ignore[attr-defined]
        h, data = h[:8], data[:8]
        out = np.zeros_like(data)
        # etcd drops the node's liveness key after its lease TTL (2 s); the directory then stops
        # offering it (its heartbeat TTL here is 30 s, so only etcd can have noticed)
        assert eventually(lambda: cc.lookup(h) == 0, timeout_s=10)
        assert cc.get_into(h, out) == 0
        # the node rejoins cleanly under the same id (empty: its arena died with it)
        cluster.start_node("node-a", [d.address], transport=transport)
        assert eventually(
            lambda: "node-a" in {n.node_id for n in cc.link.call("Nodes", directory_pb2.NodesRequest()).nodes}
        )
        assert cc.put_on("node-a", h, data).stored == 8
        assert eventually(lambda: cc.lookup(h) == 8)
        assert cc.get_into(h, out) == 8
        np.testing.assert_array_equal(out, data)


def test_directory_leader_sigkill_standby_takes_over(cluster: LocalCluster) -> None:
    d1 = cluster.start_directory("dir-1")
    d2 = cluster.start_directory("dir-2", wait_leader=False)
    with grpc.insecure_channel(d2.address) as ch:
        reply = directory_pb2_grpc.DirectoryStub(ch).Leader(directory_pb2.LeaderRequest(), timeout=2)
    assert not reply.is_leader and reply.leader == d1.address
    nodes = [cluster.start_node(n, [], etcd=True) for n in ("node-a", "node-b", "node-c")]  # find it via etcd
    # a client that only knows the standby is redirected to the leader
    with client(cluster, [d2.address], nodes[0].address) as ca:
        h = ca.hashes(np.arange(16 * 6))
        assert ca.put(h, blocks(6, 3)).stored == 6
        assert eventually(lambda: ca.lookup(h) == 6)
        assert ca.link.leader == d1.address
        d1.kill()
        # the standby wins once the leader's etcd lease (1 s) expires; nodes re-register with it
        assert eventually(lambda: _lookup_or_zero(ca, h) == 6, timeout_s=15)
        assert ca.link.leader == d2.address
        stats = ca.stats()
        assert stats["is_leader"] and stats["leader"] == d2.address


def _lookup_or_zero(c: ClusterClient, h: list[bytes]) -> int:
    try:
        return c.lookup(h)
    except Exception:
        return 0


def test_etcd_frozen_the_leader_steps_down_local_reads_go_on_and_it_leads_again(cluster: LocalCluster) -> None:
    d = cluster.start_directory()
    a, _, c_addr = start_three(cluster, [d.address])
    with client(cluster, [d.address], a) as ca, client(cluster, [d.address], c_addr) as cc:
        h = ca.hashes(np.arange(16 * 5))
        data = blocks(5, 4)
        ca.put(h, data)
        assert eventually(lambda: cc.lookup(h) == 5)
        etcd = next(p for p in cluster.procs if p.name == "etcd")
        etcd.popen.send_signal(signal.SIGSTOP)  # unreachable, as in a partition: no error, no answer
        try:
            # the leader cannot renew its lease: it stops leading (no second leader can be
            # elected meanwhile) and says why
            assert eventually(lambda: not cc.stats()["is_leader"], timeout_s=10)
            assert "unreachable" in json.dumps(cc.stats()["etcd"])
            out = np.zeros_like(data)
            assert ca.get_into(h, out) == 5  # node-a's own blocks, read from its arena
            np.testing.assert_array_equal(out, data)
        finally:
            etcd.popen.send_signal(signal.SIGCONT)
        assert eventually(lambda: cc.stats()["is_leader"] and cc.stats()["etcd"] == "ok", timeout_s=15)
        h2 = ca.hashes(np.arange(1000, 1000 + 16 * 3))
        assert ca.put(h2, blocks(3, 5)).stored == 3  # a leader again: writes land, events reach it
        assert eventually(lambda: cc.lookup(h2) == 3)
        assert eventually(lambda: cc.lookup(h) == 5)  # the nodes re-registered with the new term


def test_directory_restart_with_rocksdb_answers_from_its_state(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with LocalCluster(str(tmp_path)) as c:
        data_dir = str(tmp_path / "dirdb")
        d = c.start_directory(data_dir=data_dir, etcd=False)
        a = c.start_node("node-a", [d.address], etcd=False)
        with client(c, [d.address], a.address) as ca:
            h = ca.hashes(np.arange(16 * 4))
            ca.put(h, blocks(4, 6))
            assert eventually(lambda: ca.lookup(h) == 4)
            # the directory has written every change it knows of to RocksDB
            assert eventually(lambda: ca.stats()["unflushed_nodes"] == 0)
            port = d.address.rsplit(":", 1)[1]
            d.kill()
            a.kill()  # the node is gone too: only RocksDB can answer now
            d2 = c.start_directory("directory-2", data_dir=data_dir, etcd=False, port=int(port), node_ttl_ms=60_000)
            with grpc.insecure_channel(d2.address) as ch:
                stats = json.loads(
                    directory_pb2_grpc.DirectoryStub(ch).Stats(directory_pb2.StatsRequest(), timeout=2).json
                )
            assert stats["epoch"] == 2 and stats["blocks"] == 4


# -- tenants: the directory keys its holders by (namespace, hash) (issue 10) ------------
def test_tenant_b_cannot_remove_pin_or_read_tenant_a_through_the_cluster(cluster: LocalCluster) -> None:
    """B's directory Lookup, Remove (the reported case: it hid A's blocks from A while
    answering removed 0) and Pin of A's hashes, and its data-plane reads, change and read
    nothing; B's put under A's hashes stores its own blocks beside A's."""
    d = cluster.start_directory()
    a_addr, _, c_addr = (cluster.start_node(name, [d.address]).address for name in ("node-a", "node-b", "node-c"))
    with (
        ClusterClient.connect(SPEC, salt=b"tenant-a", directory=[d.address], local=a_addr, timeout_s=3.0) as a,
        ClusterClient.connect(SPEC, salt=b"tenant-b", directory=[d.address], local=c_addr, timeout_s=3.0) as b,
    ):
        hashes = a.hashes(np.arange(16 * 64))
        data = blocks(64, 1)
        assert a.put(hashes, data).stored == 64
        assert eventually(lambda: a.lookup(hashes) == 64)
        assert b.lookup(hashes) == 0
        out = np.zeros_like(data)
        assert b.get_into(hashes, out) == 0  # neither the directory nor a node's data plane serves it
        assert b.pin(hashes) == 0
        # the reported case: a directory Remove with B's namespace and A's hashes
        with grpc.insecure_channel(d.address) as channel:
            reply = directory_pb2_grpc.DirectoryStub(channel).Remove(
                directory_pb2.RemoveRequest(namespace=b.namespace.digest(), hashes=pack_hashes(hashes[32:])),
                timeout=5,
            )
        assert (reply.removed, reply.deferred) == (0, 0)
        assert b.remove(hashes) == 0
        assert a.lookup(hashes) == 64  # A still sees every block: no holder was forgotten
        assert a.get_into(hashes, out) == 64
        np.testing.assert_array_equal(out, data)
        # B's own put under A's hashes sits beside A's blocks
        forged = blocks(64, 2)
        assert b.put(hashes, forged).stored == 64
        assert eventually(lambda: b.lookup(hashes) == 64)
        assert a.get_into(hashes, out) == 64
        np.testing.assert_array_equal(out, data)
        assert b.remove(hashes) == 64
        assert eventually(lambda: b.lookup(hashes) == 0)
        assert a.lookup(hashes) == 64


# -- directory failover, seen from the client (docs/cluster.md) ------------------------------
# Reads are misses (``get_into`` still reads the client's own node), never errors; puts wait for
# the new leader up to ``failover_wait_ms`` and otherwise fail with one typed ``DirectoryFailover``
# (an ``Unavailable``), never the new leader's "no live node" NotFound. Run with ``-s`` to see the
# measured time to recover.


def test_leader_sigkill_reads_are_misses_puts_wait_then_one_typed_error(cluster: LocalCluster) -> None:
    d1 = cluster.start_directory("dir-1")
    d2 = cluster.start_directory("dir-2", wait_leader=False)
    a, b, c = (cluster.start_node(n, [], etcd=True).address for n in ("node-a", "node-b", "node-c"))
    dirs = [d1.address, d2.address]
    with (
        client(cluster, dirs, a, failover_wait_ms=200) as quick,  # gives up long before an election can finish
        client(cluster, dirs, b, failover_wait_ms=30_000) as patient,
        client(cluster, dirs, c, failover_wait_ms=30_000) as reader_client,
    ):
        h = quick.hashes(np.arange(16 * 8))
        data = blocks(8, 7)
        assert quick.put(h, data).stored == 8  # placed on node-a (local first)
        assert eventually(lambda: reader_client.lookup(h) == 8)
        assert patient.lookup(h) == 8  # every client has talked to dir-1

        # a reader on node-c: the blocks live on node-a, so only the directory can find them
        records: list[tuple[float, int, int]] = []  # (monotonic s when the read began, lookup, blocks read)
        errors: list[BaseException] = []
        stop = threading.Event()

        def reader() -> None:
            buf = np.zeros_like(data)
            while not stop.is_set():
                began_s = time.monotonic()
                try:
                    found = reader_client.lookup(h)
                    got = reader_client.get_into(h, buf)
                    np.testing.assert_array_equal(buf[:got], data[:got])
                    records.append((began_s, found, got))
                except BaseException as exc:  # recorded: the assertion below reports it
                    errors.append(exc)
                    return
                time.sleep(0.005)

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        assert eventually(lambda: len(records) >= 3)
        d1.kill()  # SIGKILL, and wait until the process is gone
        killed_s = time.monotonic()  # reads that began after this cannot have reached dir-1

        # a put that may not wait as long as the election: one typed, accurate error
        h2 = quick.hashes(np.arange(5000, 5000 + 16 * 2))
        with pytest.raises(DirectoryFailover) as info:
            quick.put(h2, blocks(2, 8))
        text = str(info.value)
        print(f"\nthe put's error: {text}")
        assert "failover in progress" in text and d1.address in text and d2.address in text
        assert "NOT_FOUND" not in text and "UNAVAILABLE" in text and "failover_wait_ms" in text

        # a put that may wait is placed by the new leader once the nodes re-registered
        h3 = patient.hashes(np.arange(9000, 9000 + 16 * 3))
        data3 = blocks(3, 9)
        assert patient.put(h3, data3).stored == 3
        put_done_s = time.monotonic()
        assert patient.counters["failover_put_waits"] == 1
        assert patient.link.leader == d2.address

        # reads recover on their own: the first full read after the kill
        assert eventually(lambda: any(t > killed_s and got == 8 for t, _, got in records), timeout_s=20)
        stop.set()
        thread.join(10)
        assert not errors, errors
        after = [(t, found, got) for t, found, got in records if t > killed_s]
        recovered_s = next(t for t, _, got in after if got == 8)
        misses = [r for r in after if r[0] < recovered_s]
        assert misses and all(got == 0 for _, _, got in misses)  # misses, not errors
        assert all(found == 0 for _, found, _ in misses)
        assert reader_client.counters["directory_down_reads"] > 0
        print(
            f"\nfailover: first full read {1000 * (recovered_s - killed_s):.0f} ms after SIGKILL of the leader "
            f"({len(misses)} reads were misses meanwhile); a waiting put returned after "
            f"{1000 * (put_done_s - killed_s):.0f} ms"
        )
        out = np.zeros_like(data3)
        assert eventually(lambda: reader_client.get_into(h3, out) == 3)
        np.testing.assert_array_equal(out, data3)

        # no directory at all: the client's own node still serves what it holds; puts fail typed
        d2.kill()
        assert eventually(lambda: quick.lookup(h) == 0)  # what the directory knows: nothing
        local_out = np.zeros_like(data)
        assert quick.get_into(h, local_out) == 8  # but node-a holds them: read and verified
        np.testing.assert_array_equal(local_out, data)
        assert reader_client.lookup(h) == 0 and reader_client.get_into(h, np.zeros_like(data)) == 0
        with pytest.raises(DirectoryFailover):
            quick.put(h2, blocks(2, 8))


def test_not_found_from_the_leader_that_placed_before_is_an_answer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Only a *new* leader's "no live node" is waited out: when every node of a leader that
    placed before is gone, the put says so at once."""
    with LocalCluster(str(tmp_path)) as c:
        d = c.start_directory(etcd=False, node_ttl_ms=1000)
        a = c.start_node("node-a", [d.address], etcd=False)
        with client(c, [d.address], a.address, failover_wait_ms=30_000) as cl:
            h = cl.hashes(np.arange(16 * 2))
            assert cl.put(h, blocks(2, 1)).stored == 2
            next(p for p in c.procs if p.name == "node-a").kill()

            def refused() -> bool:  # a DirectoryFailover (the 30 s wait) would escape and fail the test
                try:
                    cl.put(h, blocks(2, 1))  # node-a still listed: the write is a logged failure
                except NotFound as err:
                    assert "no live node" in err.message
                    return True
                return False

            assert eventually(refused, timeout_s=10)  # once the directory dropped node-a (1 s TTL)


def test_a_new_leader_without_nodes_is_a_failover_not_not_found(cluster: LocalCluster) -> None:
    """The nodes die with the leader, so none ever re-registers with the standby: the put
    waits through "no live node is registered" from the new leader and then says what it saw."""
    d1 = cluster.start_directory("dir-1")
    d2 = cluster.start_directory("dir-2", wait_leader=False)
    cluster.start_node("node-a", [], etcd=True)
    with ClusterClient.connect(
        SPEC, salt=b"t", directory=[d1.address, d2.address], timeout_s=3.0, failover_wait_ms=8_000
    ) as cl:
        h = cl.hashes(np.arange(16 * 2))
        assert eventually(lambda: len(cl.link.call("Nodes", directory_pb2.NodesRequest()).nodes) == 1)
        assert cl.put(h, blocks(2, 1)).stored == 2
        for proc in [p for p in cluster.procs if p.name in ("node-a", "dir-1")]:
            proc.kill()
        with pytest.raises(DirectoryFailover) as info:
            cl.put(h, blocks(2, 1))
        text = str(info.value)
        assert f"the new leader {d2.address}" in text and "no node registered" in text, text
        assert "no live node is registered" in text  # what the leader said, as the cause
        assert cl.link.leader == d2.address


def test_a_block_rotten_on_a_remote_node_is_reported_dropped_there_and_healed(cluster: LocalCluster) -> None:
    """Issue 11 item 2 across nodes: a block that rotted in node-a's arena fails its checksum
    when node-c's client reads it over the data plane; the client reports it, node-a
    re-verifies and drops it (REMOVED), the directory stops listing node-a as its holder,
    and the next put stores fresh bytes that read back whole."""
    from kvpool.proto import pool_pb2, pool_pb2_grpc

    d = cluster.start_directory()
    a = cluster.start_node("node-a", [d.address]).address
    c_addr = cluster.start_node("node-c", [d.address]).address
    with client(cluster, [d.address], a) as ca, client(cluster, [d.address], c_addr) as cc:
        h = ca.hashes(np.arange(16 * 6))
        data = blocks(6, 5)
        assert ca.put(h, data).stored == 6
        assert eventually(lambda: cc.lookup(h) == 6)
        local = ca.local
        assert local is not None
        with grpc.insecure_channel(a) as ch:
            stub = pool_pb2_grpc.PoolStub(ch)
            lease = stub.Lease(pool_pb2.HashesRequest(namespace=local.namespace.digest(), hashes=pack_hashes(h)))
            stub.Release(pool_pb2.ReleaseRequest(lease_ids=[lease.lease_id]))
        writable_arena(local)[lease.offsets[3] + 11] ^= 0x42  # rot in node-a's arena, after commit
        out = np.zeros_like(data)
        assert cc.get_into(h, out) == 3  # a miss from the rotten block on, never wrong bytes
        np.testing.assert_array_equal(out[:3], data[:3])
        assert cc.counters["reported_corrupt"] == 1 and cc.counters["dropped_corrupt"] == 1
        with grpc.insecure_channel(a) as ch:
            a_stats = json.loads(pool_pb2_grpc.PoolStub(ch).Stats(pool_pb2.StatsRequest(), timeout=5).json)
        assert a_stats["checksum_failures"] == 1
        assert eventually(lambda: cc.lookup(h) == 3)  # the directory dropped node-a as the holder
        assert ca.put(h, data).stored == 1  # the engine recomputed block 3: fresh bytes
        assert eventually(lambda: cc.lookup(h) == 6)
        out[:] = 0
        assert cc.get_into(h, out) == 6
        np.testing.assert_array_equal(out, data)
