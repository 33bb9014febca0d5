"""``recv_rows``: rows received from a real loopback TCP socket and hashed as they land get
exactly the xxh3-64 of their bytes (the xxhash package's digest), however the sender cuts
the stream; a stream that stops early yields the rows received whole and the reason; the
socket is left as the caller's Python code expects it (``SO_RCVLOWAT`` back to 1)."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.transport import recv_rows, wire

pytestmark = pytest.mark.skipif(recv_rows._native is None, reason="the native module was not built")


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()
    receiver.settimeout(10)  # as the data plane's sockets: non-blocking underneath
    try:
        yield sender, receiver
    finally:
        sender.close()
        receiver.close()


def _send_in_cuts(sock: socket.socket, data: bytes, cuts: list[int], pause_s: float = 0.0) -> threading.Thread:
    def run() -> None:
        view = memoryview(data)
        at = 0
        for cut in cuts:
            if at >= len(view):
                break
            sock.sendall(view[at : at + cut])
            at += cut
            if pause_s:
                time.sleep(pause_s)
        sock.sendall(view[at:])

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


ROW_BYTES = st.sampled_from([241, 255, 1023, 1024, 1025, 1088, 4096, 65_537, 262_144, 262_145, 1_048_576 + 64])


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(ROW_BYTES, min_size=1, max_size=12),
    cuts=st.lists(st.integers(1, 300_000), max_size=20),
    seed=st.integers(0, 2**32 - 1),
    scalar=st.booleans(),
)
def test_digests_are_the_rows_xxh3(sizes: list[int], cuts: list[int], seed: int, scalar: bool) -> None:
    """Both kernels (the CPU's, and the portable one every host can fall back to)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()
    receiver.settimeout(10)
    try:
        data = np.random.default_rng(seed).integers(0, 256, sum(sizes), dtype=np.uint8).tobytes()
        rows = [np.zeros(n, np.uint8) for n in sizes]
        thread = _send_in_cuts(sender, data, cuts)
        piece = recv_rows.RECV_PIECE_BYTES
        digests, status, _ = recv_rows._native.recv_rows(receiver.fileno(), rows, 30.0, piece, scalar)
        thread.join()
        assert status == 0
        assert b"".join(r.tobytes() for r in rows) == data
        assert digests == [xxhash.xxh3_64_intdigest(r.tobytes()) for r in rows]
        assert _lowat(receiver) == 1
    finally:
        sender.close()
        receiver.close()


def test_a_peer_that_closes_mid_row_yields_the_whole_rows_before(pair: tuple[socket.socket, socket.socket]) -> None:
    sender, receiver = pair
    rows = [np.zeros(300_000, np.uint8) for _ in range(3)]
    data = bytes(range(256)) * 2000  # 512,000 bytes: one row and part of the next
    sender.sendall(data)
    sender.close()
    digests, failure = recv_rows.receive(receiver, rows, time.monotonic() + 10)
    assert digests == [xxhash.xxh3_64_intdigest(data[:300_000])]
    assert isinstance(failure, wire.PeerClosed)
    assert _lowat(receiver) == 1


def test_a_stalled_peer_runs_into_the_deadline(pair: tuple[socket.socket, socket.socket]) -> None:
    sender, receiver = pair
    rows = [np.zeros(4096, np.uint8), np.zeros(1 << 20, np.uint8)]
    sender.sendall(b"\x07" * (4096 + 1000))  # the second row never completes
    started = time.monotonic()
    digests, failure = recv_rows.receive(receiver, rows, time.monotonic() + 0.3)
    assert 0.25 < time.monotonic() - started < 5
    assert digests == [xxhash.xxh3_64_intdigest(b"\x07" * 4096)]
    assert isinstance(failure, TimeoutError)
    assert _lowat(receiver) == 1
    # the socket still works for Python's own receive afterwards (SO_RCVLOWAT is back to 1)
    sender.sendall(b"x")
    receiver.settimeout(2)
    assert receiver.recv(1 << 20)[-1:] == b"x"


def test_a_trickling_peer_is_received_whole(pair: tuple[socket.socket, socket.socket]) -> None:
    sender, receiver = pair
    data = bytes(range(256)) * 4096  # 1 MiB in 64 KiB cuts with pauses: many waits with SO_RCVLOWAT
    rows = [np.zeros(len(data), np.uint8)]
    thread = _send_in_cuts(sender, data, [65_536] * 15, pause_s=0.01)
    digests, failure = recv_rows.receive(receiver, rows, time.monotonic() + 10)
    thread.join()
    assert failure is None and digests == [xxhash.xxh3_64_intdigest(data)]


def test_short_and_read_only_rows_are_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    _, receiver = pair
    assert not recv_rows.usable(receiver, [np.zeros(240, np.uint8)])
    assert recv_rows.usable(receiver, [np.zeros(241, np.uint8)])
    with pytest.raises(ValueError, match="more than 240"):
        recv_rows._native.recv_rows(receiver.fileno(), [np.zeros(240, np.uint8)], 1.0, 4096)
    read_only = np.zeros(4096, np.uint8)
    read_only.flags.writeable = False
    with pytest.raises((BufferError, ValueError), match="read-only"):
        recv_rows._native.recv_rows(receiver.fileno(), [read_only], 1.0, 4096)


def test_a_signal_handler_that_raises_stops_the_receive_at_once(pair: tuple[socket.socket, socket.socket]) -> None:
    """Ctrl-C during a read: the handler runs at the interrupted wait, as with recv_into,
    not when the read's deadline passes."""
    _, receiver = pair

    class Interrupted(Exception):
        pass

    def handler(signum: int, frame: object) -> None:
        raise Interrupted()

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        started = time.monotonic()
        with pytest.raises(Interrupted):
            recv_rows.receive(receiver, [np.zeros(1 << 20, np.uint8)], time.monotonic() + 10)
        assert time.monotonic() - started < 5
        assert _lowat(receiver) == 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("timeout_s", [float("nan"), -1.0])
def test_a_timeout_that_is_not_a_duration_is_refused(
    pair: tuple[socket.socket, socket.socket], timeout_s: float
) -> None:
    _, receiver = pair
    with pytest.raises(ValueError, match="timeout_s"):
        recv_rows._native.recv_rows(receiver.fileno(), [np.zeros(4096, np.uint8)], timeout_s, 4096)
