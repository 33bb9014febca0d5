"""The daemon's local-call server in this process (``kvpool.daemon.local_calls``): an accept
that fails (no descriptors left) is retried, not the end of the socket; stop lets a call in
flight answer."""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from kvpool.core.supervisor import Supervisor
from kvpool.daemon.local_calls import LocalCallServer
from kvpool.rpc.local_call import MAGIC, LocalCallKeys, pack_call, read_frame, send_frame
from kvpool.rpc.serving import TypedMethod


class Reply:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data


def echo_server(path: Path, slow_s: float = 0.0) -> LocalCallServer:
    def echo(raw: bytes, context: Any) -> Reply:
        time.sleep(slow_s)
        return Reply(raw)

    methods = {"Echo": TypedMethod("Echo", echo, Reply, server_streaming=False)}
    return LocalCallServer(methods, str(path), LocalCallKeys(), None, "node", 1 << 20)


def admitted(path: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(5.0)
    conn.connect(str(path))
    send_frame(conn, MAGIC, os.urandom(32))
    assert (read_frame(conn, 1 << 13) or b"")[:1] == b"K"  # the proof
    send_frame(conn, b"")
    assert read_frame(conn, 64) == b"K"
    return conn


class FailingAccepts:
    """The listening socket, whose first ``failures`` accepts fail as they do when the
    process has no descriptor left."""

    def __init__(self, sock: socket.socket, failures: int) -> None:
        self._sock, self.failures = sock, failures

    def accept(self) -> tuple[socket.socket, Any]:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self._sock.accept()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def test_failed_accepts_are_retried(tmp_path: Path) -> None:
    server, supervisor = echo_server(tmp_path / "s.sock"), Supervisor()
    server.start(supervisor)
    try:
        real = server._sock
        assert real is not None
        failing = FailingAccepts(real, failures=3)
        server._sock = failing  # type: ignore[assignment]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as nudge:
            nudge.connect(server.path)  # wakes the loop blocked in the real accept
        deadline = time.monotonic() + 5
        while failing.failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failing.failures == 0
        with admitted(tmp_path / "s.sock") as conn:  # still accepting
            send_frame(conn, *pack_call("Echo", b"ping"))
            assert read_frame(conn, 64) == b"Kping"
    finally:
        server.stop(1.0)
        supervisor.stop()


def test_stop_ends_idle_connections_without_waiting_out_the_grace(tmp_path: Path) -> None:
    server, supervisor = echo_server(tmp_path / "s.sock"), Supervisor()
    server.start(supervisor)
    conns = [admitted(tmp_path / "s.sock") for _ in range(3)]  # idle: waiting for a call
    threads = list(server._conns.values())
    assert len(threads) == 3
    server.stop(60.0)
    assert not any(thread.is_alive() for thread in threads)  # each saw the end, none was waited out
    for conn in conns:
        assert read_frame(conn, 64) is None
        conn.close()
    supervisor.stop()


class SlowClose:
    """An accepted connection whose close takes a while (a kernel that is slow to let go)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def close(self) -> None:
        time.sleep(0.3)
        self._sock.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def test_stop_waits_for_a_connection_that_has_left_the_table_but_is_still_closing(tmp_path: Path) -> None:
    server, supervisor = echo_server(tmp_path / "s.sock"), Supervisor()
    admit = server._admit
    server._admit = lambda conn: admit(SlowClose(conn))  # type: ignore[method-assign,arg-type]
    close = server.close

    def close_then_pause() -> None:  # the thread sees the end and leaves _conns before join looks
        close()
        time.sleep(0.1)

    server.close = close_then_pause  # type: ignore[method-assign]
    server.start(supervisor)
    conn = admitted(tmp_path / "s.sock")
    threads = list(server._conns.values())
    server.stop(60.0)  # the thread leaves _conns at once, then spends 0.3 s closing
    assert not any(thread.is_alive() for thread in threads)
    conn.close()
    supervisor.stop()


def test_stop_lets_a_call_in_flight_answer(tmp_path: Path) -> None:
    server, supervisor = echo_server(tmp_path / "s.sock", slow_s=0.5), Supervisor()
    server.start(supervisor)
    conn = admitted(tmp_path / "s.sock")
    send_frame(conn, *pack_call("Echo", b"late"))
    time.sleep(0.1)  # the handler is running
    stopper = threading.Thread(target=server.stop, args=(5.0,))
    stopper.start()
    assert read_frame(conn, 64) == b"Klate"  # answered, then the connection ends
    assert read_frame(conn, 64) is None
    stopper.join(5)
    assert not stopper.is_alive() and not (tmp_path / "s.sock").exists()
    conn.close()
    supervisor.stop()
