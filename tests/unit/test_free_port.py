"""``free_port``: a port a server can bind now, drawn below the kernel's ephemeral range so that
outgoing connections and port-0 servers (which draw from that range) cannot take it between
the call and the server's bind; and ``listens_on``, with which readiness probes make sure
the server answering on "our" port is ours (both seen as a CI failure under parallel runs)."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys

import pytest

from kvpool.daemon import launcher


def test_free_port_is_bindable_and_below_the_ephemeral_range_where_there_is_room() -> None:
    top = launcher._ephemeral_floor()
    ports = {launcher.free_port() for _ in range(20)}
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    if top - launcher.FREE_PORT_FLOOR >= 1_000:  # else free_port falls back to a kernel-picked port
        assert len(ports) > 1  # drawn at random, not one fixed port
        assert all(launcher.FREE_PORT_FLOOR <= port < top for port in ports)


def test_free_port_falls_back_to_the_kernel_when_the_range_below_is_too_small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "_ephemeral_floor", lambda: launcher.FREE_PORT_FLOOR + 10)
    port = launcher.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_free_port_skips_a_taken_port(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        offsets = itertools.chain([port - launcher.FREE_PORT_FLOOR] * 3, itertools.count(1))
        monkeypatch.setattr(launcher, "_ephemeral_floor", lambda: 61_000)  # the taken port lies in the range
        monkeypatch.setattr(launcher.secrets, "randbelow", lambda _n: next(offsets))
        got = launcher.free_port()
        assert got != port and launcher.FREE_PORT_FLOOR < got < 61_000  # three draws of the taken port skipped


@pytest.mark.skipif(not os.path.isdir("/proc/net"), reason="needs /proc")
def test_listens_on_tells_whose_socket_listens_on_a_port() -> None:
    with socket.socket() as mine:
        mine.bind(("127.0.0.1", 0))
        port = mine.getsockname()[1]
        assert not launcher.listens_on(os.getpid(), port)  # bound, not listening yet
        mine.listen(1)
        assert launcher.listens_on(os.getpid(), port)
    child = subprocess.Popen(
        [sys.executable, "-c", "import socket,sys,time; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(1);"
         "print(s.getsockname()[1], flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        theirs = int(child.stdout.readline())
        assert launcher.listens_on(child.pid, theirs)
        assert not launcher.listens_on(os.getpid(), theirs)  # another process's server on the port
    finally:
        child.kill()
        child.wait()
