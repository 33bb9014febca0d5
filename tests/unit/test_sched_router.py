"""Router core, event follower (gap -> resync) and the HTTP / gRPC endpoints, in process."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from kvpool.core.clock import FakeClock
from kvpool.core.errors import InvalidArgument, NotFound
from kvpool.core.events import EventKind, KVEvent
from kvpool.core.hashing import block_hashes, pack_hashes
from kvpool.core.spec import KVSpec, Namespace
from kvpool.proto import router_pb2, router_pb2_grpc
from kvpool.scheduler.cluster import ClusterSpec, Slo
from kvpool.scheduler.cost_model import get_preset
from kvpool.scheduler.policies import make_policy
from kvpool.scheduler.router_core import RouterCore, WorkerLoad
from kvpool.scheduler.router_events import EventFollower
from kvpool.scheduler.router_server import RouterServer

SPEC = KVSpec(model="router-unit", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=16)
NS = Namespace(SPEC)


def core(clock: FakeClock | None = None) -> RouterCore:
    cluster = ClusterSpec(num_prefill=2, num_decode=1, block_tokens=16)
    return RouterCore(
        cluster, get_preset("llama3-8b-a100x1"), make_policy("kv-centric"), clock or FakeClock(), NS, Slo(5_000, 200)
    )


def tokens(n_blocks: int, base: int = 0) -> list[int]:
    return list(range(base, base + n_blocks * 16))


def test_events_from_an_instance_and_from_the_pool() -> None:
    c = core()
    hs = block_hashes(NS, np.array(tokens(4)))
    c.apply_event(KVEvent("prefill-1", 1, EventKind.STORED, tuple(hs[:3])))
    r = c.route(c.request_from(tokens(4), None, 0, 10, None))
    assert r.prefill_instance == "prefill-1" and r.decision.expected_hit_blocks == 3
    c.apply_event(KVEvent("pool-node", 1, EventKind.STORED, tuple(hs)))
    r = c.route(c.request_from(tokens(4), None, 0, 10, None))
    assert r.decision.expected_hit_blocks == 4 and r.expected_hit_tokens == 63  # capped at prompt - 1
    c.apply_event(KVEvent("pool-node", 2, EventKind.CLEARED, ()))
    c.apply_event(KVEvent("prefill-1", 2, EventKind.REMOVED, tuple(hs[:3])))
    assert c.route(c.request_from(tokens(4), None, 0, 10, None)).decision.expected_hit_blocks == 0
    other = KVEvent("pool-node", 3, EventKind.STORED, tuple(hs), namespace=b"x" * 16)
    c.apply_event(other)  # another namespace's blocks are not ours
    assert c.stats()["indexed_blocks"] == 0


def test_reports_steer_and_own_charges_spread_a_burst() -> None:
    clock = FakeClock()
    c = core(clock)
    c.report(WorkerLoad("prefill-0", queue_ms=10_000))
    r = c.route(c.request_from(tokens(8, 5000), None, 0, 10, Slo(50_000, 200)))
    assert r.prefill_instance == "prefill-1"
    c.report(WorkerLoad("prefill-0", queue_ms=0))
    c.report(WorkerLoad("prefill-1", queue_ms=0))
    firsts = {
        c.route(c.request_from(tokens(200, 9000 + i * 7), None, 0, 10, Slo(1e9, 1e9))).prefill_instance
        for i in range(4)
    }
    assert firsts == {"prefill-0", "prefill-1"}  # its own charges make prefill-1 busy too
    clock.advance(1e9)  # time passes: the charged queues drain
    with pytest.raises(NotFound):
        c.report(WorkerLoad("nope"))
    with pytest.raises(InvalidArgument):
        c.report(WorkerLoad("prefill-0", queue_ms=-1))


def test_bad_requests_are_clear_errors() -> None:
    c = core()
    with pytest.raises(InvalidArgument, match="exactly one"):
        c.request_from(None, None, 0, 1, None)
    with pytest.raises(InvalidArgument, match="16 bytes"):
        c.request_from(None, [b"short"], 0, 1, None)
    with pytest.raises(InvalidArgument, match="shorter"):
        c.request_from(None, [b"x" * 16, b"y" * 16], 5, 1, None)
    r = c.route(c.request_from(tokens(400), None, 0, 1, Slo(ttft_ms=1, tpot_ms=1)))
    assert r.decision.rejected and r.prefill_instance == "" and c.stats()["rejections"] == 1


class FakeSource:
    """Snapshot + a scripted event stream; records how often it was opened."""

    def __init__(self, script: list[list[KVEvent]], snaps: list[tuple[int, list[bytes]]]) -> None:
        self.script, self.snaps = script, snaps
        self.node_id = "pool-node"
        self.opened = 0
        self.done = threading.Event()

    def connect(self) -> FakeSource:
        self.opened += 1
        return self

    def snapshot(self) -> tuple[int, list[bytes]]:
        return self.snaps[min(self.opened - 1, len(self.snaps) - 1)]

    def events(self, from_seq: int) -> Iterator[KVEvent]:
        i = self.opened - 1
        if i < len(self.script):
            yield from self.script[i]
        else:
            self.done.set()
            self.done.wait()

    def close(self) -> None:
        pass


def test_follower_resyncs_on_a_sequence_gap() -> None:
    c = core()
    a, b, x = b"a" * 16, b"b" * 16, b"x" * 16
    ev = lambda seq, h: KVEvent("pool-node", seq, EventKind.STORED, (h,))  # noqa: E731
    src = FakeSource(script=[[ev(5, a), ev(6, b), ev(9, x)], []], snaps=[(4, []), (9, [a, x])])
    f = EventFollower(src.connect, c)
    f.follow_once()
    assert f.gaps == 1 and c.state.index.holds(b, c.spec.pool_member) and not c.state.index.holds(x, 2)
    f.follow_once()  # the second connection resyncs from the snapshot: b was evicted meanwhile
    assert c.state.index.holds(x, c.spec.pool_member) and not c.state.index.holds(b, c.spec.pool_member)
    assert c.resyncs == 2 and c.events_applied == 2


@pytest.fixture
def server() -> Iterator[RouterServer]:
    s = RouterServer(core(), "127.0.0.1:0", "127.0.0.1:0")
    s.start()
    yield s
    s.stop()


def _post(addr: str, path: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_http_endpoint(server: RouterServer) -> None:
    hs = block_hashes(NS, np.array(tokens(3)))
    server.core.apply_event(KVEvent("prefill-0", 1, EventKind.STORED, tuple(hs)))
    status, body = _post(server.http_address, "/route", {"token_ids": tokens(3), "output_tokens": 5})
    assert status == 200 and body["prefill_instance"] == "prefill-0" and body["expected_hit_blocks"] == 3
    status, body = _post(server.http_address, "/route", {"hashes": [h.hex() for h in hs], "input_tokens": 60})
    assert status == 200 and body["expected_hit_blocks"] == 3
    assert _post(server.http_address, "/report", {"instance": "decode-0", "active_requests": 3})[0] == 200
    status, body = _post(server.http_address, "/report", {"instance": "ghost"})
    assert status == 404 and body["error"] == "NOT_FOUND"
    status, body = _post(server.http_address, "/route", {"output_tokens": 5})
    assert status == 400 and body["error"] == "INVALID_ARGUMENT"
    with urllib.request.urlopen(f"http://{server.http_address}/stats", timeout=5) as resp:
        assert json.loads(resp.read())["decisions"] == 2


def test_grpc_endpoint(server: RouterServer) -> None:
    hs = block_hashes(NS, np.array(tokens(2)))
    with grpc.insecure_channel(server.grpc_address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        reply = stub.Route(router_pb2.RouteRequest(hashes=pack_hashes(hs), output_tokens=3), timeout=5)
        assert not reply.rejected and reply.decode_instance == "decode-0" and reply.expected_ttft_ms > 0
        stub.Report(router_pb2.WorkerReport(instance="prefill-1", queue_ms=5.0), timeout=5)
        with pytest.raises(grpc.RpcError) as exc:
            stub.Route(router_pb2.RouteRequest(output_tokens=3), timeout=5)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stub.Stats(router_pb2.StatsRequest(), timeout=5).decisions == 1
