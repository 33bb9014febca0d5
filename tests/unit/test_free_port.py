"""``free_port``: a port a server can bind now, drawn below the kernel's ephemeral range so that
outgoing connections and port-0 servers (which draw from that range) cannot take it between
the call and the server's bind; and the test harness's probe, which must not mistake another
process's daemon on "our" port for ours (both seen as a CI failure under parallel runs)."""

from __future__ import annotations

import socket

import pytest
from conftest import _ARENA_PID

from kvpool.daemon import launcher


def test_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    top = launcher._ephemeral_floor()
    ports = {launcher.free_port() for _ in range(20)}
    assert len(ports) > 1  # drawn at random, not one fixed port
    for port in ports:
        assert launcher.FREE_PORT_FLOOR <= port < top
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_free_port_skips_a_taken_port(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        draws = iter([port - launcher.FREE_PORT_FLOOR] * 3 + [1])
        monkeypatch.setattr(launcher, "_ephemeral_floor", lambda: 61_000)  # the taken port lies in the range
        monkeypatch.setattr(launcher.secrets, "randbelow", lambda _n: next(draws))
        assert launcher.free_port() == launcher.FREE_PORT_FLOOR + 1  # three draws of the taken port skipped


def test_the_probe_reads_the_daemons_pid_from_its_arena_path() -> None:
    match = _ARENA_PID.search("/dev/shm/kvpool-test-x/kvpool-10118-433ed6d9.arena")
    assert match is not None and int(match.group(1)) == 10118
    assert _ARENA_PID.search("") is None
