"""KV events in vLLM's wire format: encoding, and a real ZMQ PUB/SUB round trip."""

from __future__ import annotations

import threading
import time

import pytest

from kvpool.core.events import EventKind, KVEvent
from kvpool.daemon.cluster_events import VllmEventPublisher, decode_batch, encode_batch
from kvpool.daemon.event_log import EventLog

H = [bytes([i]) * 16 for i in range(4)]


def test_encoding_matches_vllm_array_like_tagged_structs() -> None:
    events = [
        KVEvent("n", 1, EventKind.STORED, (H[0], H[1]), "host", b"", b"", 16),
        KVEvent("n", 2, EventKind.REMOVED, (H[0],), "disk"),
        KVEvent("n", 3, EventKind.CLEARED, ()),
    ]
    ts, decoded = decode_batch(encode_batch(events, 12.5))
    assert ts == 12.5
    assert decoded[0] == ["BlockStored", [H[0], H[1]], None, [], 16, None, "CPU"]
    assert decoded[1] == ["BlockRemoved", [H[0]], "DISK"]
    assert decoded[2] == ["AllBlocksCleared"]


def test_publisher_sends_topic_seq_payload_frames_following_the_log() -> None:
    zmq = pytest.importorskip("zmq")
    log = EventLog("node-a")
    publisher = VllmEventPublisher("tcp://127.0.0.1:0", topic="kv")
    endpoint = publisher._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    stopping = threading.Event()
    thread = threading.Thread(target=publisher.run, args=(log, stopping), daemon=True)
    thread.start()
    frames = None
    for _ in range(50):  # PUB/SUB joins late: publish until the subscriber sees one
        log.append(EventKind.STORED, [H[2]], b"", 16)
        try:
            frames = sub.recv_multipart(flags=zmq.NOBLOCK)
            break
        except zmq.Again:
            time.sleep(0.1)
    if frames is None:
        frames = sub.recv_multipart()
    stopping.set()
    thread.join(2)
    sub.close(0)
    topic, seq, payload = frames
    assert topic == b"kv"
    assert 0 <= int.from_bytes(seq, "big") < log.last_seq  # batches are numbered 0, 1, 2, ...
    _, events = decode_batch(payload)
    assert events[0][0] == "BlockStored" and events[0][1] == [H[2]]


def test_replay_returns_buffered_batches_from_the_asked_seq_then_the_end_marker() -> None:
    zmq = pytest.importorskip("zmq")
    publisher = VllmEventPublisher(
        "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_batches=3, wall_clock=lambda: 7.0
    )
    replay_endpoint = publisher._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
    for i in range(5):  # batches 0..4; the buffer keeps 2, 3, 4
        publisher.publish([KVEvent("n", i + 1, EventKind.STORED, (H[i % 4],), "host", b"", b"", 16)])
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(replay_endpoint)
    dealer.send_multipart((b"", (3).to_bytes(8, "big")))
    deadline = time.monotonic() + 5
    while not publisher.serve_replays() and time.monotonic() < deadline:
        time.sleep(0.01)
    replies = [dealer.recv_multipart() for _ in range(3)]
    dealer.close(0)
    publisher.close()
    assert [int.from_bytes(r[1], "big", signed=True) for r in replies] == [3, 4, -1]
    ts, events = decode_batch(replies[0][2])
    assert ts == 7.0 and events[0][1] == [H[3]]
    assert replies[2][2] == b""
