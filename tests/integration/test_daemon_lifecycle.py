"""The daemon as a process: graceful SIGTERM, a client killed while holding a lease,
restart with automatic namespace re-registration, the event stream and snapshot, and
``kvpool inspect stats --json``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import REPO_ROOT, DaemonHandle

from kvpool import KVSpec, PoolClient
from kvpool.core.errors import CapacityExhausted
from kvpool.core.events import EventKind, KVEvent
from kvpool.proto import pool_pb2, pool_pb2_grpc

SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
TOKENS = list(range(16 * 8))
WAIT_S = 20.0


def make_blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**16, (n, *SPEC.block_shape), dtype=np.uint16).view(np.float16)


def stats(address: str) -> dict[str, Any]:
    with grpc.insecure_channel(address) as channel:
        reply = pool_pb2_grpc.PoolStub(channel).Stats(pool_pb2.StatsRequest(), timeout=10)
    result: dict[str, Any] = json.loads(reply.json)
    return result


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll a condition (behaviour, not timing: the bound only stops a hung test)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_sigterm_exits_0_and_removes_the_arena(daemon_factory: Any) -> None:
    daemon: DaemonHandle = daemon_factory()
    with PoolClient.connect(daemon.address, SPEC) as client:
        client.put(client.hashes(TOKENS)[:2], make_blocks(2, seed=1))
        arena = stats(daemon.address)["arena_path"]
        assert daemon.arena_files() == [arena] and os.path.exists(arena)
        os.kill(daemon.pid, signal.SIGTERM)
        assert daemon.proc.wait(WAIT_S) == 0
    assert not os.path.exists(arena)
    assert daemon.arena_files() == []
    assert "signal 15" in daemon.stderr() and "stopped" in daemon.stderr()


def test_a_daemon_a_test_starts_checks_its_invariants_sampled(daemon_factory: Any) -> None:
    """The tests' daemons run with debug invariants (sampled, kvpool/core/invariants.py):
    the daemon says so once at start, and puts, reads and removes still work under them."""
    daemon: DaemonHandle = daemon_factory()
    with PoolClient.connect(daemon.address, SPEC) as client:
        hashes = client.hashes(TOKENS)
        blocks = make_blocks(len(hashes), seed=2)
        client.put(hashes, blocks)
        assert np.stack(client.get(hashes)).view(np.uint16).tobytes() == blocks.view(np.uint16).tobytes()
        client.remove(hashes[:3])
        assert len(client.get(hashes)) == 0
    assert daemon.stderr().count("debug invariants on, sampled") == 1


_CHILD_LEASE_HOLDER = """
import sys, time
from kvpool import KVSpec, PoolClient
spec = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
c = PoolClient.connect(sys.argv[1], spec)
got = c.get(c.hashes(list(range(16))))  # the lease's release is deferred to the next call
print(len(got), flush=True)
time.sleep(600)
"""


def test_sigkill_of_a_client_holding_a_lease_lets_the_lease_expire(daemon_factory: Any) -> None:
    daemon: DaemonHandle = daemon_factory(
        "--slab-bytes", "256KiB", "--high-watermark", "1.0", "--low-watermark", "1.0",
        "--lease-ttl-ms", "400", "--sweep-interval-ms", "50", capacity="1MiB",
    )  # fmt: skip
    slots = (1 << 20) // SPEC.block_bytes
    with PoolClient.connect(daemon.address, SPEC) as client:
        hashes = client.hashes(list(range(16 * (slots + 1))))
        assert client.put(hashes[:slots], make_blocks(slots, seed=2)).stored == slots
        assert client.pin(hashes[1:slots]) == slots - 1  # only block 0 could ever be evicted
        child = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_CHILD_LEASE_HOLDER), daemon.address],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "1"
            assert stats(daemon.address)["leases_active"] == 1
            with pytest.raises(CapacityExhausted):  # block 0 is leased by the child
                client.put(hashes[slots:], make_blocks(1, seed=3))
            os.kill(child.pid, signal.SIGKILL)
            child.wait(WAIT_S)
        finally:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
                child.wait(WAIT_S)
        wait_until(lambda: stats(daemon.address)["leases_active"] == 0, "the dead client's lease to expire")
        assert stats(daemon.address)["expired_leases"] >= 1
        assert client.put(hashes[slots:], make_blocks(1, seed=3)).stored == 1  # block 0 was evicted for it
        assert client.lookup(hashes[:1]) == 0 and client.lookup(hashes[1 : slots + 1]) == slots
        assert stats(daemon.address)["evictions"] == 1
    assert daemon.proc.poll() is None


def test_restart_re_registers_the_namespace_and_remaps_the_arena(daemon_factory: Any) -> None:
    first: DaemonHandle = daemon_factory()
    client = PoolClient.connect(first.address, SPEC, salt=b"t")
    try:
        hashes = client.hashes(TOKENS)
        client.put(hashes[:3], make_blocks(3, seed=4))
        old_arena = stats(first.address)["arena_path"]
        assert first.stop() == 0
        second: DaemonHandle = daemon_factory(port=first.port)
        assert stats(second.address)["arena_path"] != old_arena
        assert client.lookup(hashes) == 0  # a fresh daemon: empty, and no UnknownNamespace surfaced
        blocks = make_blocks(4, seed=5)
        assert client.put(hashes[:4], blocks).stored == 4  # written through the NEW arena mapping
        assert client.get(hashes).tobytes() == blocks.tobytes()
        namespaces = stats(second.address)["namespaces"]
        assert [ns["digest"] for ns in namespaces] == [client.namespace.digest().hex()]
    finally:
        client.close()


def _collect(client: PoolClient, count: int, sink: list[KVEvent]) -> None:
    for event in client.events(from_seq=1):
        sink.append(event)
        if len(sink) >= count:
            return


def test_events_stream_and_snapshot(pool_daemon: DaemonHandle) -> None:
    with PoolClient.connect(pool_daemon.address, SPEC) as writer, \
            PoolClient.connect(pool_daemon.address, SPEC) as watcher:  # fmt: skip
        hashes = writer.hashes(TOKENS)
        events: list[KVEvent] = []
        thread = threading.Thread(target=_collect, args=(watcher, 3, events), daemon=True)
        thread.start()
        writer.put(hashes[:3], make_blocks(3, seed=6))
        assert writer.remove([hashes[1], hashes[7]]) == 1
        writer.put(hashes[3:5], make_blocks(2, seed=7))
        thread.join(WAIT_S)
        assert not thread.is_alive() and len(events) == 3
        assert [e.seq for e in events] == [1, 2, 3]  # consecutive: no gap
        assert [e.kind for e in events] == [EventKind.STORED, EventKind.REMOVED, EventKind.STORED]
        assert [list(e.hashes) for e in events] == [hashes[:3], [hashes[1]], hashes[3:5]]
        ns = writer.namespace.digest()
        assert all(e.namespace == ns and e.node_id == pool_daemon.address for e in events)
        assert events[0].block_tokens == 16
        last_seq, present = writer.snapshot()
        assert last_seq == 3
        assert sorted(present) == sorted([hashes[0], hashes[2], hashes[3], hashes[4]])
        # a late subscriber replays from any seq
        late: list[KVEvent] = []
        _collect_from = threading.Thread(target=lambda: late.extend(_take(watcher, 2, 2)), daemon=True)
        _collect_from.start()
        _collect_from.join(WAIT_S)
        assert [e.seq for e in late] == [2, 3]


def _take(client: PoolClient, from_seq: int, count: int) -> list[KVEvent]:
    out: list[KVEvent] = []
    for event in client.events(from_seq=from_seq):
        out.append(event)
        if len(out) >= count:
            break
    return out


def test_inspect_stats_json(pool_daemon: DaemonHandle) -> None:
    with PoolClient.connect(pool_daemon.address, SPEC) as client:
        hashes = client.hashes(TOKENS)
        client.put(hashes[:2], make_blocks(2, seed=8))
        client.get(hashes[:3])  # 2 hits, 1 miss
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "inspect", "stats", "--json", "--address", pool_daemon.address],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["capacity_bytes"] == 64 << 20
    assert data["blocks"] == 2 and data["used_bytes"] == 2 * SPEC.block_bytes
    assert data["hits"] == 2 and data["misses"] == 1
    for key in ("evictions", "lookups", "puts", "node_id", "hash_scheme"):
        assert key in data
    human = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "inspect", "stats", "--address", pool_daemon.address],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert human.returncode == 0 and "evictions" in human.stdout and "hit rate" in human.stdout


def test_inspect_against_a_dead_address_fails_with_a_message() -> None:
    from conftest import free_port

    address = f"127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "inspect", "stats", "--json", "--address", address],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert address in done.stderr and "UNAVAILABLE" in done.stderr


def test_second_daemon_on_a_busy_port_exits_1(pool_daemon: DaemonHandle, tmp_path: Any) -> None:
    """grpc.server enables SO_REUSEPORT by default: without turning it off, a second daemon would
    share the port and clients would land on either one."""
    err_path = tmp_path / "second.stderr"
    with open(err_path, "wb") as err:
        second = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", "serve", "--listen", pool_daemon.address,
             "--capacity-bytes", "16MiB", "--arena-dir", str(tmp_path)],
            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        # either it exits (correct) or it announces that it is serving (the bug): no timing involved
        wait_until(lambda: second.poll() is not None or "serving on" in err_path.read_text(), "the second daemon")
        text = err_path.read_text()
        assert "serving on" not in text, "a second daemon is serving on a port already in use"
        assert second.returncode == 1 and "cannot listen" in text and pool_daemon.address in text
    finally:
        if second.poll() is None:
            os.kill(second.pid, signal.SIGTERM)
            second.wait(WAIT_S)


def test_the_daemon_keeps_its_index_out_of_full_collections_unless_told_not_to(daemon_factory: Any) -> None:
    """``kvpool serve`` freezes what survives a full collection (``--gc-freeze``, on by
    default; kvpool.daemon.gc_pauses), says so in Stats and runs the whole pass every
    ``--gc-full-interval-s`` (here 1 s, warned about); ``off`` leaves the collector as CPython
    has it. Blocks put before a whole pass read back whole after it."""
    frozen = daemon_factory("--gc-full-interval-s", "1")
    plain = daemon_factory("--gc-freeze", "off")
    for handle in (frozen, plain):
        with PoolClient.connect(handle.address, SPEC) as client:
            hashes = client.hashes(TOKENS)
            blocks = make_blocks(len(hashes), seed=11)
            assert client.put(hashes, blocks).stored == len(hashes)
            if handle is frozen:
                passes = stats(frozen.address)["gc_whole_passes"]
                wait_until(lambda n=passes: stats(frozen.address)["gc_whole_passes"] > n, "a whole pass")
            out = np.zeros_like(blocks)
            assert client.get_into(hashes, out) == len(hashes)
            assert np.array_equal(out.view(np.uint16), blocks.view(np.uint16))
    on, off = stats(frozen.address), stats(plain.address)
    assert on["gc_frozen_objects"] > 10_000  # the daemon's modules and structures, at least
    assert on["gc_whole_pass_seconds_last"] > 0
    assert "gc_frozen_objects" not in off and "gc_whole_passes" not in off
    frozen.proc.send_signal(signal.SIGTERM)
    assert frozen.proc.wait(30) == 0
    assert "pauses the daemon that often" in frozen.stderr() and "whole pass over" in frozen.stderr()
