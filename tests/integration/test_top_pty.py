"""``kvpool top`` in a real pseudo-terminal against a real daemon: it takes the alternate
screen, redraws in place (cursor home, no scrolling log), shows the node, its tiers and hit
rate, and quits on ``q`` or Ctrl-C, restoring the screen. Piped, it prints plain frames.
With ``--directory`` against a real 3-node cluster it shows every member, refreshes, quits on
``q`` with exit 0 and leaves no process behind."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import termios
import time
from typing import Any

import numpy as np
import pytest
from conftest import REPO_ROOT, DaemonHandle

from kvpool import KVSpec, PoolClient

SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
ALT_SCREEN_ON, ALT_SCREEN_OFF = b"\x1b[?1049h", b"\x1b[?1049l"
WAIT_S = 60.0


def _own_terminal() -> None:
    """In the child: a new session whose controlling terminal is the pty (so Ctrl-C typed
    there is SIGINT to top, as in a real terminal)."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def start_top(*target: str) -> tuple[subprocess.Popen[bytes], int]:
    """``kvpool top`` with ``target`` (``--address A`` or ``--directory D``) on a new pty.
    util-linux's ``setsid --ctty`` does ``_own_terminal`` in the child where it exists: a
    ``preexec_fn`` runs Python between fork and exec in a child of this threaded process."""
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")} | {"COLUMNS": "160", "LINES": "50"}
    argv = [sys.executable, "-m", "kvpool.cli.main", "top", *target, "--interval-s", "0.2"]
    setsid = shutil.which("setsid")
    proc = subprocess.Popen(
        [setsid, "--ctty", *argv] if setsid else argv,
        cwd=REPO_ROOT, stdin=slave, stdout=slave, stderr=slave, env=env,
        preexec_fn=None if setsid else _own_terminal,
    )  # fmt: skip
    os.close(slave)
    return proc, master


def read_until(master: int, done: object, sink: bytearray) -> None:
    """Read the terminal until ``done(sink)`` (behaviour, not timing: the bound stops a hang)."""
    deadline = time.monotonic() + WAIT_S
    while not done(sink):  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out; screen so far: {bytes(sink[-2000:])!r}"
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                sink.extend(os.read(master, 65536))
            except OSError:  # the child closed the terminal
                return


def drain_until_exit(proc: subprocess.Popen[bytes], master: int, sink: bytearray) -> int:
    deadline = time.monotonic() + WAIT_S
    while proc.poll() is None:
        assert time.monotonic() < deadline, "top did not exit"
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                sink.extend(os.read(master, 65536))
            except OSError:
                break
    return proc.wait(10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("quit_key", [b"q", b"\x03"], ids=["q", "ctrl-c"])
def test_top_redraws_in_place_and_quits(pool_daemon: DaemonHandle, quit_key: bytes) -> None:
    with PoolClient.connect(pool_daemon.address, SPEC) as client:
        hashes = client.hashes(list(range(16 * 4)))
        client.put(hashes[:3], np.zeros((3, *SPEC.block_shape), dtype=np.float16))
        client.lookup(hashes)  # 3 of 4 blocks
    proc, master = start_top("--address", pool_daemon.address)
    screen = bytearray()
    try:
        read_until(master, lambda s: s.count(b"kvpool top") >= 3, screen)  # three refreshes
        assert ALT_SCREEN_ON in screen  # full screen, not a scrolling log
        text = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", bytes(screen))  # the characters drawn, without styles
        assert b"75.0% (3 of 4 blocks)" in text and b"host" in text and b"throughput" in text
        os.write(master, quit_key)
        assert drain_until_exit(proc, master, screen) == 0
        assert ALT_SCREEN_OFF in screen[screen.rindex(b"kvpool top") :]  # the terminal is given back
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        os.close(master)


def test_top_piped_prints_plain_frames(pool_daemon: DaemonHandle) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "top", "--iterations", "2", "--interval-s", "0.1",
         "--address", pool_daemon.address],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2 and all("lookup hit rate n/a" in line for line in lines)
    assert "\x1b" not in done.stdout


@pytest.mark.timeout(180)
def test_top_of_a_three_node_cluster_refreshes_and_quits_leaving_nothing(three_nodes: Any) -> None:
    directory, (a, b, _) = three_nodes
    with PoolClient.connect(a, SPEC) as on_a, PoolClient.connect(b, SPEC) as on_b:
        hashes = on_a.hashes(list(range(16 * 4)))
        on_a.put(hashes[:2], np.zeros((2, *SPEC.block_shape), dtype=np.float16))
        on_b.put(hashes[:1], np.zeros((1, *SPEC.block_shape), dtype=np.float16))
    proc, master = start_top("--directory", directory)
    screen = bytearray()
    try:
        read_until(master, lambda s: s.count(b"kvpool top") >= 3, screen)  # three refreshes
        assert ALT_SCREEN_ON in screen
        text = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", bytes(screen))
        assert all(name in text for name in (b"node-a", b"node-b", b"node-c")), text[-3000:]
        os.write(master, b"q")
        assert drain_until_exit(proc, master, screen) == 0
        assert ALT_SCREEN_OFF in screen[screen.rindex(b"kvpool top") :]
        with pytest.raises(ProcessLookupError):  # top's session (it ran as its leader) is empty
            os.killpg(proc.pid, 0)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        os.close(master)
