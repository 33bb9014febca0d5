"""Every thread has an owner that joins it (issue 16, item 2): after each owner's stop, no
thread it started is alive, so nothing runs on against resources the owner then closes.
(The data-plane workers: ``test_transport_threads.py``; the disk tier's recovery thread:
``test_tiers_disk_locks.py``; the HTTP servers' request workers: ``test_http_server.py``.)"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator

import torch
from prometheus_client import CollectorRegistry

from kvpool.connectors.pool_api import InProcessPool
from kvpool.connectors.vllm import BackgroundSaver, ConnectorStats
from kvpool.core.clock import FakeClock
from kvpool.core.events import KVEvent
from kvpool.core.spec import KVSpec, Namespace
from kvpool.core.supervisor import Supervisor
from kvpool.core.words import WordTokenizer
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


def alive(*names: str) -> set[str]:
    return {t.name for t in threading.enumerate()} & set(names)


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
    before = threading.active_count()
    for _ in range(3):
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=WAIT_S) as reply:
            assert reply.status == 200
    assert threading.active_count() == before  # no thread per scrape
    server.stop()
    supervisor.stop()
    assert alive("kvpool-metrics-http") == set()


def test_the_vllm_background_saver_is_joined_by_stop() -> None:
    pool = InProcessPool(SPEC)
    saver = BackgroundSaver(pool, 1 << 20, ConnectorStats())
    hashes = pool.hashes(list(range(16)))
    assert saver.submit(hashes, torch.zeros((1, *SPEC.block_shape), dtype=torch.float16))
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
    names = ("kvpool-router-http", "kvpool-openai-http", "kvpool-openai-health", "AnyIO worker thread")
    assert alive(*names) == set()
