"""The node's event log: consecutive seqs, bounded memory with a visible gap, blocking readers."""

from __future__ import annotations

import threading

from kvpool.core.events import EventKind
from kvpool.core.supervisor import Supervisor
from kvpool.daemon.event_log import EventLog

NS = b"\x01" * 16


def test_seqs_are_consecutive_from_one() -> None:
    log = EventLog("node-a")
    seqs = [log.append(EventKind.STORED, [bytes([i]) * 16], NS, 16) for i in range(4)]
    assert seqs == [1, 2, 3, 4] and log.last_seq == 4
    events = log.read_from(1, wait_s=0)
    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert events[2].hashes == (bytes([2]) * 16,) and events[2].node_id == "node-a"
    assert events[0].namespace == NS and events[0].block_tokens == 16
    assert [e.seq for e in log.read_from(3, wait_s=0)] == [3, 4]
    assert log.read_from(5, wait_s=0) == []


def test_bounded_log_shows_a_gap_to_late_readers() -> None:
    log = EventLog("n", capacity_events=3)
    for i in range(5):
        log.append(EventKind.REMOVED, [bytes([i]) * 16], NS)
    events = log.read_from(1, wait_s=0)
    assert [e.seq for e in events] == [3, 4, 5]  # 1, 2 are gone: the reader sees seq 3 != 1 and resyncs
    assert log.last_seq == 5


def test_follow_blocks_until_an_event_and_stops_on_close() -> None:
    log = EventLog("n")
    seen: list[int] = []
    done = threading.Event()

    def reader() -> None:
        for event in log.follow(0, lambda: True):
            seen.append(event.seq)
        done.set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    log.append(EventKind.STORED, [b"\x00" * 16], NS)
    log.append(EventKind.CLEARED, [], NS)
    log.close()
    thread.join(10)
    assert done.is_set() and not thread.is_alive()
    assert seen == [1, 2]


def test_supervisor_crash_stops_the_daemon_loudly() -> None:
    sup = Supervisor()

    def boom() -> None:
        raise RuntimeError("disk on fire")

    sup.spawn("boom", boom)
    assert sup.stopping.wait(10)
    assert isinstance(sup.failure, RuntimeError) and "disk on fire" in str(sup.failure)
    sup.stop()


def test_supervisor_every_runs_until_stopped() -> None:
    sup = Supervisor()
    ticks = threading.Semaphore(0)
    sup.every("tick", 1, ticks.release)
    assert all(ticks.acquire(timeout=10) for _ in range(3))
    sup.stop()
    assert sup.failure is None


def test_append_records_the_tier_the_blocks_live_in() -> None:
    log = EventLog("n1")
    log.append(EventKind.STORED, [b"\x01" * 16], NS, 16)  # a caller that names no tier: host
    log.append(EventKind.STORED, [b"\x01" * 16], NS, 16, tier="disk")
    log.append(EventKind.STORED, [b"\x02" * 16], NS, tier="device")
    assert [(e.seq, e.tier) for e in log.read_from(1, 0)] == [(1, "host"), (2, "disk"), (3, "device")]
