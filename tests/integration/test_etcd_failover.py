"""Leader election through a real etcd, with the leader cut off from etcd by a proxy
(a black hole, not a crash): one leader at a time, the cut-off one stops serving writes
before the other is elected, and it comes back as a standby, never as a second leader.
Node membership runs on the same session and is followed by a watch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from netcut import CuttableProxy

from kvpool.core.errors import NotLeader
from kvpool.daemon.cluster_local import LocalCluster, etcd_binary, eventually
from kvpool.directory.election import LeaderElection
from kvpool.directory.etcd import EtcdSession, find_leader
from kvpool.directory.membership import Membership, MemberWatch
from kvpool.proto import directory_pb2, directory_pb2_grpc
from kvpool.rpc.errors import from_rpc_error

pytestmark = [
    pytest.mark.etcd,
    pytest.mark.skipif(etcd_binary() is None, reason="etcd binary not installed (apt-get install etcd-server)"),
]


@pytest.fixture
def etcd(tmp_path) -> Iterator[str]:  # type: ignore[no-untyped-def]
    with LocalCluster(str(tmp_path)) as c:
        yield c.start_etcd().address


def _crash(exc: BaseException) -> None:
    raise AssertionError(f"an etcd role crashed: {exc!r}")


class Overlaps:
    """Samples two instances' ``is_leader`` on a thread, newcomer first: a sample where both
    say yes means the old leader still led after the new one had started leading."""

    def __init__(self, old: LeaderElection, new: LeaderElection) -> None:
        self.old, self.new = old, new
        self.both = 0
        self.samples = 0
        self.new_led = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-overlaps", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            new = self.new.is_leader()
            old = self.old.is_leader()
            self.samples += 1
            self.both += int(new and old)
            self.new_led |= new
            self._stop.wait(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_a_leader_cut_off_from_etcd_steps_down_before_the_standby_leads(etcd: str) -> None:
    with CuttableProxy(etcd) as proxy:
        sa, sb = EtcdSession([proxy.address], timeout_s=0.5).start(), EtcdSession([etcd], timeout_s=0.5).start()
        a = LeaderElection(sa, "t", "dir-a", ttl_s=2)
        b = LeaderElection(sb, "t", "dir-b", ttl_s=2)
        try:
            a.start(_crash, first_round_s=5)
            assert a.is_leader() and a.term > 0
            b.start(_crash, first_round_s=5)
            assert not b.is_leader() and b.leader_address == "dir-a"
            first_term = a.term
            watch = Overlaps(a, b)
            proxy.cut()
            assert eventually(b.is_leader, timeout_s=15)
            assert not a.is_leader()
            assert b.term > first_term
            proxy.restore()
            # back in touch: a finds b's key and stands by; it never leads again meanwhile
            assert eventually(lambda: a.leader_address == "dir-b" and a.etcd_ok, timeout_s=15)
            assert not a.is_leader() and b.is_leader()
            watch.stop()
            assert watch.samples > 100 and watch.new_led
            assert watch.both == 0
            assert a.terms_won == 1 and b.terms_won == 1
        finally:
            a.resign()
            b.resign()
            sa.close()
            sb.close()
            proxy.close()


def test_a_leader_that_steps_down_for_a_cut_never_says_etcd_is_ok(etcd: str) -> None:
    """The status a directory reports (``is_leader``, ``etcd_ok``) is read on another thread
    than the renewal: from the instant a cut-off leader stops leading it must also say etcd
    is unreachable (a lease that ran out unrenewed), never "not leader, etcd ok" for the
    moment its unanswered renewal takes to time out. The session's timeout is the
    directory's own (2 s, longer than the renewal's budget), as in ``kvpool directory``."""
    with CuttableProxy(etcd) as proxy:
        session = EtcdSession([proxy.address]).start()
        a = LeaderElection(session, "t", "dir-a", ttl_s=2)
        try:
            a.start(_crash, first_round_s=5)
            assert a.is_leader() and a.etcd_ok
            proxy.cut()
            contradictions, stepped_down_samples = 0, 0
            deadline = time.monotonic() + 15
            while stepped_down_samples < 500 and time.monotonic() < deadline:
                leads, ok = a.is_leader(), a.etcd_ok
                if not leads:
                    stepped_down_samples += 1
                    contradictions += int(ok)
                time.sleep(0.0005)
            assert stepped_down_samples == 500  # it stepped down
            assert contradictions == 0
        finally:
            proxy.restore()
            a.resign()
            session.close()


def test_resign_hands_over_at_once_and_terms_grow(etcd: str) -> None:
    sa, sb = EtcdSession([etcd]).start(), EtcdSession([etcd]).start()
    a = LeaderElection(sa, "t", "dir-a", ttl_s=30)  # without the resign b would wait 30 s
    b = LeaderElection(sb, "t", "dir-b", ttl_s=30)
    try:
        a.start(_crash, first_round_s=5)
        b.start(_crash, first_round_s=5)
        term_a = a.term
        assert find_leader(sb, "t") == "dir-a"
        a.resign()
        assert not a.is_leader()
        assert eventually(b.is_leader, timeout_s=5)  # a watch, not the TTL
        assert b.term > term_a
        assert find_leader(sa, "t") == "dir-b"
    finally:
        b.resign()
        sa.close()
        sb.close()


def test_membership_keys_follow_their_leases_and_the_watch_sees_them(etcd: str) -> None:
    with CuttableProxy(etcd) as proxy:
        node_session = EtcdSession([proxy.address], timeout_s=0.5).start()
        dir_session = EtcdSession([etcd]).start()
        watch = MemberWatch(dir_session, "t")
        m1 = Membership(node_session, "t", "node-1", {"host": "h"}, ttl_s=2)
        m2 = Membership(node_session, "t", "node-2", {"host": "h"}, ttl_s=2)
        try:
            watch.start(_crash)
            assert watch.synced.wait(5)
            m1.start(_crash, first_round_s=5)
            m2.start(_crash, first_round_s=5)
            assert eventually(lambda: watch.live() == {"node-1", "node-2"}, timeout_s=5)
            assert watch.absent_since_ms("node-1") == 0.0
            m2.leave()  # revoked: gone at once
            assert eventually(lambda: watch.live() == {"node-1"}, timeout_s=5)
            assert watch.absent_since_ms("node-2") > 0
            proxy.cut()  # node-1 cannot renew: etcd expires its lease
            assert eventually(lambda: watch.live() == set(), timeout_s=15)
            proxy.restore()  # it joins again under a new lease
            assert eventually(lambda: watch.live() == {"node-1"}, timeout_s=15)
        finally:
            m1.leave()
            node_session.close()
            dir_session.close()
            proxy.close()


def _leader_reply(address: str) -> directory_pb2.LeaderReply:
    with grpc.insecure_channel(address) as ch:
        return directory_pb2_grpc.DirectoryStub(ch).Leader(directory_pb2.LeaderRequest(), timeout=2)


def test_directory_cut_off_from_etcd_refuses_writes_and_the_standby_takes_over(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with LocalCluster(str(tmp_path)) as c:
        etcd_address = c.start_etcd().address
        with CuttableProxy(etcd_address) as proxy:
            d1 = c.start_directory("dir-1", etcd=False, extra=["--etcd", proxy.address])
            d2 = c.start_directory("dir-2", wait_leader=False)
            assert not _leader_reply(d2.address).is_leader
            proxy.cut()
            assert eventually(lambda: _leader_reply(d2.address).is_leader, timeout_s=20)
            # dir-1 answers, but no longer as a leader: a node's registration is refused
            assert not _leader_reply(d1.address).is_leader
            with grpc.insecure_channel(d1.address) as ch:
                request = directory_pb2.HeartbeatRequest(node_id="node-x")
                with pytest.raises(grpc.RpcError) as info:
                    directory_pb2_grpc.DirectoryStub(ch).Heartbeat(request, timeout=2)
            assert isinstance(from_rpc_error(info.value, d1.address), NotLeader)
            proxy.restore()
            assert eventually(lambda: _leader_reply(d1.address).leader == d2.address, timeout_s=20)
            assert not _leader_reply(d1.address).is_leader
