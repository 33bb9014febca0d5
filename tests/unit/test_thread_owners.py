"""Every thread has an owner that joins it (issue 16, item 2): after each owner's stop, no
thread it started is alive, so nothing runs on against resources the owner then closes.
(The data-plane workers: ``test_transport_threads.py``; the disk tier's recovery thread:
``test_tiers_disk_locks.py``; the HTTP servers' request workers: ``test_http_server.py``.)"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.request
from collections.abc import Iterator

import pytest
import torch
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvpool.connectors.paged_io import stage_blocks
from kvpool.connectors.pool_api import InProcessPool
from kvpool.connectors.vllm import BackgroundSaver, ConnectorStats
from kvpool.core.clock import FakeClock
from kvpool.core.events import KVEvent
from kvpool.core.spec import KVSpec, Namespace
from kvpool.core.supervisor import Supervisor
from kvpool.core.words import WordTokenizer
from kvpool.rpc.http_json import HttpLimits, HttpServer, Worker
from kvpool.rpc.metrics import MetricsServer
from kvpool.scheduler.cluster import ClusterSpec
from kvpool.scheduler.cost_model import get_preset
from kvpool.scheduler.policies import make_policy
from kvpool.scheduler.router_core import RouterCore
from kvpool.scheduler.router_events import EventFollower
from kvpool.scheduler.router_openai import FrontDoor, FrontDoorServer, Instance, SplitPolicy
from kvpool.scheduler.router_server import RouterServer

SPEC = KVSpec(model="threads", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=16)
WAIT_S = 20.0


@pytest.fixture(autouse=True)
def no_thread_left() -> Iterator[None]:
    """Every thread a test starts (by whatever name) is gone when it ends: compared by object
    against the threads alive before it, so other tests' threads do not count."""
    before = set(threading.enumerate())
    _BEFORE_TEST[:] = before
    yield
    new = [t for t in threading.enumerate() if t not in before]
    for t in new:
        t.join(5)  # one that is ending anyway (an anyio worker handing back its last result)
    left = [t.name for t in new if t.is_alive()]
    assert left == [], f"threads still alive after their owners stopped: {left}"


_BEFORE_TEST: list[threading.Thread] = []  # the threads alive when the running test began


def alive(*names: str) -> set[str]:
    """Which of ``names`` a thread started by this test still has (threads that earlier tests
    left running, e.g. another connector's saver of the same name, do not count)."""
    return {t.name for t in threading.enumerate() if t not in _BEFORE_TEST} & set(names)


def router_core(policy: object | None = None, decode: int = 1) -> RouterCore:
    cluster = ClusterSpec(num_prefill=1, num_decode=decode, block_tokens=16)
    return RouterCore(
        cluster, get_preset("llama3-8b-a100x1"), policy or make_policy("kv-centric"), FakeClock(), Namespace(SPEC)
    )  # type: ignore[arg-type]


class BlockingSource:
    """An event source whose stream blocks until it is closed (a live pool with no news)."""

    node_id = "pool-node"

    def __init__(self) -> None:
        self.streaming = threading.Event()
        self.closed = threading.Event()

    def snapshot(self) -> tuple[int, list[bytes]]:
        return 0, []

    def events(self, from_seq: int) -> Iterator[KVEvent]:
        self.streaming.set()
        self.closed.wait(WAIT_S)
        return iter(())

    def close(self) -> None:
        self.closed.set()


def test_the_router_event_follower_is_joined_by_stop() -> None:
    source = BlockingSource()
    follower = EventFollower(lambda: source, router_core())
    follower.start()
    assert source.streaming.wait(WAIT_S)
    follower.stop()
    assert source.closed.is_set() and alive("router-events") == set()


def test_the_router_event_follower_under_the_supervisor_is_joined() -> None:
    source = BlockingSource()
    follower = EventFollower(lambda: source, router_core())
    supervisor = Supervisor()
    supervisor.spawn("router-events", follower.run)  # as kvpool router runs it
    assert source.streaming.wait(WAIT_S)
    follower.stop()  # ends its stream: run() returns
    supervisor.stop()
    assert alive("kvpool-router-events") == set() and supervisor.failure is None


def test_the_metrics_server_runs_on_the_supervisors_thread_only() -> None:
    supervisor = Supervisor()
    server = MetricsServer("127.0.0.1:0", CollectorRegistry())
    supervisor.spawn("metrics-http", server.serve)
    before = set(threading.enumerate())
    for _ in range(3):
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=WAIT_S) as reply:
            assert reply.status == 200
    assert [t.name for t in threading.enumerate() if t not in before] == []  # no thread per scrape
    server.stop()
    supervisor.stop()
    assert alive("kvpool-metrics-http") == set()


def test_the_vllm_background_saver_is_joined_by_stop() -> None:
    pool = InProcessPool(SPEC)
    saver = BackgroundSaver(pool, 1 << 20, ConnectorStats())
    assert alive("kvpool-vllm-saver") == {"kvpool-vllm-saver"}
    hashes = pool.hashes(list(range(16)))
    block = torch.zeros((1, *SPEC.block_shape), dtype=torch.float16)
    assert saver.submit(
        hashes,
        SPEC.block_bytes,
        lambda: stage_blocks(pool, SPEC, torch.float16, hashes, lambda f, c, out: out.copy_(block)),
    )
    saver.stop()
    assert alive("kvpool-vllm-saver") == set() and pool.lookup(hashes) == 1


def test_the_router_http_and_front_door_threads_are_joined_by_stop() -> None:
    server = RouterServer(router_core(), "127.0.0.1:0", "127.0.0.1:0")
    server.start()
    with urllib.request.urlopen(f"http://{server.http_address}/stats", timeout=WAIT_S) as reply:
        assert reply.status == 200
    server.stop()
    policy = SplitPolicy(128)
    core = router_core(policy, decode=1)
    instances = [Instance(name, "http://127.0.0.1:9") for name in core.names]
    front = FrontDoorServer(FrontDoor(core, policy, instances, WordTokenizer.for_vocab(64), "m"), "127.0.0.1:0")
    front.start()
    with urllib.request.urlopen(f"http://{front.address}/health", timeout=WAIT_S) as reply:
        assert reply.status == 200
    front.stop()
    assert alive("kvpool-router-http", "kvpool-openai-http", "kvpool-openai-health") == set()


class SlowEngine:
    """An engine's ``/v1/completions`` stream that goes on until its client lets go."""

    def __init__(self) -> None:
        self.closed = threading.Event()
        worker = Worker(HttpLimits())

        def tokens() -> Iterator[dict[str, object]]:
            try:
                for i in range(100_000):
                    yield {"choices": [{"index": 0, "text": "w", "token_ids": [i % 50]}]}
                    self.closed.wait(0.01)  # pacing: an engine makes a token now and then
            finally:
                self.closed.set()

        async def completions(request: Request) -> Response:
            return worker.events(tokens())

        self.server = HttpServer(
            Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])]),
            "127.0.0.1:0",
            HttpLimits(),
            "fake-engine",
        )


def test_a_client_gone_from_the_front_door_lets_go_of_the_engine_stream() -> None:
    engine = SlowEngine()
    engine.server.start()
    policy = SplitPolicy(10_000)  # every prompt prefills on the decode instance
    core = router_core(policy, decode=1)
    instances = [Instance(name, f"http://{engine.server.address}") for name in core.names]
    door = FrontDoor(core, policy, instances, WordTokenizer.for_vocab(64), "m")
    front = FrontDoorServer(door, "127.0.0.1:0")
    front.start()
    try:
        host, _, port = front.address.rpartition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "w1 w2", "max_tokens": 4000, "stream": True}))
        resp = conn.getresponse()
        assert resp.status == 200
        got = 0
        for raw in resp:
            got += raw.startswith(b"data:")
            if got == 3:
                break
        assert door.stats()["active"]["decode-0"] == 1
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        assert engine.closed.wait(WAIT_S)  # the front door closed its stream from the engine
    finally:
        front.stop()
        engine.server.stop()
    assert door.stats()["active"]["decode-0"] == 0
