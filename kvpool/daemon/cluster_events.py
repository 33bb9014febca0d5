"""KV events in vLLM's wire format (msgpack over ZMQ PUB), so routers built for vLLM's
``kv_events`` (llm-d, Dynamo, vLLM's own subscriber example) can consume a kvpool node.

Wire format, as vLLM's ``ZmqEventPublisher`` sends it: a 3-frame multipart message
``[topic, seq as 8-byte big-endian, payload]`` where payload is the msgpack encoding of a
msgspec ``array_like`` struct ``KVEventBatch = [ts, events]`` and each event is a tagged
array_like struct whose first element is its class name:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Block hashes are kvpool's 16-byte chain hashes (vLLM's ``ExternalBlockHash`` is bytes or
int). ``token_ids`` is empty: a node stores blocks by hash and never sees tokens. Batches
are numbered 0, 1, 2, ... (vLLM's seq), so a subscriber sees a gap
exactly when it missed a batch and can replay it (or resync from the node's Snapshot).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from kvpool.core.events import EventKind, KVEvent
from kvpool.daemon.event_log import EventLog

log = logging.getLogger("kvpool.kv_events")

MEDIUM = {"host": "CPU", "device": "GPU", "disk": "DISK"}
MAX_EVENTS_PER_BATCH = 256


def event_to_vllm(event: KVEvent) -> list[Any]:
    medium = MEDIUM.get(event.tier, event.tier.upper())
    if event.kind is EventKind.STORED:
        parent = event.parent_hash or None
        return ["BlockStored", list(event.hashes), parent, [], event.block_tokens, None, medium]
    if event.kind is EventKind.REMOVED:
        return ["BlockRemoved", list(event.hashes), medium]
    return ["AllBlocksCleared"]


def encode_batch(events: Sequence[KVEvent], ts: float) -> bytes:
    """msgpack of vLLM's ``KVEventBatch`` (array_like, omit_defaults: no dp rank)."""
    packed: bytes = msgpack.packb([ts, [event_to_vllm(e) for e in events]], use_bin_type=True)
    return packed


def decode_batch(payload: bytes) -> tuple[float, list[list[Any]]]:
    """The inverse, for tests and the CLI: (ts, events as tagged lists)."""
    ts, events, *_ = msgpack.unpackb(payload, raw=False)
    return float(ts), [list(e) for e in events]


class VllmEventPublisher:
    """Follows a node's event log and publishes each batch on a ZMQ PUB socket, numbering
    batches 0, 1, 2, ... as vLLM does; keeps the last ``buffer_batches`` for replay.

    Replay (vLLM's protocol, optional): a DEALER sends ``[b"", start_seq (8 bytes, big
    endian)]`` to the ROUTER at ``replay_endpoint`` and receives ``[b"", seq, payload]`` for
    every buffered batch from ``start_seq`` on, then ``[b"", -1 (8 bytes, signed), b""]``.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str = "",
        buffer_batches: int = 10_000,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        import zmq

        self.endpoint = endpoint
        self.topic = topic.encode("utf-8")
        self._zmq: Any = zmq
        self._ctx: Any = zmq.Context.instance()
        self._sock: Any = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._replay: Any = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_batches)
        self._next_batch = 0
        self._wall_clock = wall_clock
        self.published = 0
        self._lock = threading.Lock()

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> None:
        if not events:
            return
        payload = encode_batch(events, self._wall_clock() if ts is None else ts)
        with self._lock:
            seq = self._next_batch
            self._next_batch += 1
            self._buffer.append((seq, payload))
            self._sock.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self.published += len(events)

    def serve_replays(self) -> int:
        """Answer waiting replay requests; returns how many were answered."""
        if self._replay is None:
            return 0
        zmq = self._zmq
        answered = 0
        while self._replay.poll(0, zmq.POLLIN):
            frames = self._replay.recv_multipart()
            if len(frames) < 3 or len(frames[-1]) != 8:
                continue
            client, start = frames[0], int.from_bytes(frames[-1], "big")
            with self._lock:
                batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
            for seq, payload in batches:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", (-1).to_bytes(8, "big", signed=True), b""))
            answered += 1
        return answered

    def run(self, log_: EventLog, stopping: threading.Event) -> None:
        next_seq = log_.last_seq + 1  # a subscriber joining now starts from the present
        while not stopping.is_set():
            events = log_.read_from(next_seq, wait_s=0.1)
            if events and events[0].seq > next_seq:
                log.warning(
                    "kv events %d..%d were dropped from the node's log before publishing: "
                    "subscribers must resync from a snapshot",
                    next_seq,
                    events[0].seq - 1,
                )
            for start in range(0, len(events), MAX_EVENTS_PER_BATCH):
                self.publish(events[start : start + MAX_EVENTS_PER_BATCH])
            if events:
                next_seq = events[-1].seq + 1
            self.serve_replays()
        self.close()

    def close(self) -> None:
        self._sock.close(0)
        if self._replay is not None:
            self._replay.close(0)
