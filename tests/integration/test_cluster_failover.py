"""Directory leader failover, seen from the cluster client (real etcd, two directories and
three node daemons on loopback): reads are misses (``get_into`` still reads the client's own
node), never errors; puts wait
for the new leader up to ``failover_wait_ms`` and otherwise fail with one typed
``DirectoryFailover`` (an ``Unavailable``), never the new leader's "no live node" NotFound.

Run with ``-s`` to see the measured time to recover.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.client.cluster_client import ClusterClient, DirectoryFailover
from kvpool.core.errors import NotFound
from kvpool.core.spec import KVSpec
from kvpool.daemon.cluster_local import LocalCluster, etcd_binary, eventually
from kvpool.proto import directory_pb2

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


def connect(directories: list[str], local: str, failover_wait_ms: int) -> ClusterClient:
    return ClusterClient.connect(
        SPEC, salt=b"t", directory=directories, local=local, timeout_s=3.0, failover_wait_ms=failover_wait_ms
    )


def test_leader_sigkill_reads_are_misses_puts_wait_then_one_typed_error(cluster: LocalCluster) -> None:
    d1 = cluster.start_directory("dir-1")
    d2 = cluster.start_directory("dir-2", wait_leader=False)
    a, b, c = (cluster.start_node(n, [], etcd=True).address for n in ("node-a", "node-b", "node-c"))
    dirs = [d1.address, d2.address]
    with (
        connect(dirs, a, failover_wait_ms=200) as quick,  # gives up long before an election can finish
        connect(dirs, b, failover_wait_ms=30_000) as patient,
        connect(dirs, c, failover_wait_ms=30_000) as reader_client,
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
        with connect([d.address], a.address, failover_wait_ms=30_000) as client:
            h = client.hashes(np.arange(16 * 2))
            assert client.put(h, blocks(2, 1)).stored == 2
            next(p for p in c.procs if p.name == "node-a").kill()

            def refused() -> bool:  # a DirectoryFailover (the 30 s wait) would escape and fail the test
                try:
                    client.put(h, blocks(2, 1))  # node-a still listed: the write is a logged failure
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
    ) as client:
        h = client.hashes(np.arange(16 * 2))
        assert eventually(lambda: len(client.link.call("Nodes", directory_pb2.NodesRequest()).nodes) == 1)
        assert client.put(h, blocks(2, 1)).stored == 2
        for proc in [p for p in cluster.procs if p.name in ("node-a", "dir-1")]:
            proc.kill()
        with pytest.raises(DirectoryFailover) as info:
            client.put(h, blocks(2, 1))
        text = str(info.value)
        assert f"the new leader {d2.address}" in text and "no node registered" in text, text
        assert "no live node is registered" in text  # what the leader said, as the cause
        assert client.link.leader == d2.address
