"""``LocalCluster`` children (``kvpool cluster up``, ``kvpool demo``): pinned to the CPUs they
are given and stopped by the kernel when their supervisor dies, even by SIGKILL, and set up
without running Python between fork and exec in the supervisor's child (a ``preexec_fn`` in a
child of a threaded parent can deadlock before exec: a CI run saw a node that never started).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool.daemon import launcher

SUPERVISOR = """
import os, sys, threading, time
from kvpool.daemon.launcher import LocalCluster
# a threaded parent, as the real supervisor is (its gRPC probes): the case preexec_fn got wrong
threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
cluster = LocalCluster(sys.argv[1], die_with_parent=True)
cpu = min(os.sched_getaffinity(0))
# not Python: an interpreter sets SIGPIPE to ignored itself, which would hide the shim's
proc = cluster.spawn("child", ["sleep", "120"], "", cpus=[cpu])
print(proc.popen.pid, flush=True)
time.sleep(120)
"""


def _state(pid: int) -> str:
    """The process state letter of ``/proc/PID/stat`` ("" once the process is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and CPU sets are Linux")
def test_a_child_is_pinned_execs_its_program_and_dies_with_its_supervisor(tmp_path: Path) -> None:
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert supervisor.stdout is not None
        child = int(supervisor.stdout.readline())
        deadline = time.monotonic() + 30  # behaviour, not timing: the bound only stops a hang
        cmdline = b""
        while time.monotonic() < deadline:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if cmdline.split(b"\0")[:2] == [b"sleep", b"120"]:
                break  # the shim has exec'd the program itself
            time.sleep(0.05)
        assert cmdline.split(b"\0")[:2] == [b"sleep", b"120"], cmdline
        assert os.sched_getaffinity(child) == {min(os.sched_getaffinity(0))}
        ignored = int(
            next(
                line for line in Path(f"/proc/{child}/status").read_text().splitlines() if line.startswith("SigIgn:")
            ).split()[1],
            16,
        )
        assert not ignored & (1 << (signal.SIGPIPE - 1)), "the shim left SIGPIPE ignored for the program"
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(10)
        while time.monotonic() < deadline and _state(child) not in ("", "Z"):
            time.sleep(0.05)
        assert _state(child) in ("", "Z"), "the child outlived its SIGKILLed supervisor"
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait(10)
        if child and _state(child) not in ("", "Z"):
            os.kill(child, signal.SIGKILL)


def test_children_are_started_without_a_preexec_fn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Whatever the options, ``spawn`` passes the child's setup in its argv (the shim), never
    as Python code run between fork and exec."""
    seen: list[dict[str, object]] = []

    class Recorder:
        def __init__(self, argv: list[str], **kwargs: object) -> None:
            seen.append({"argv": argv, **kwargs})
            self.pid = 0

    monkeypatch.setattr(launcher.subprocess, "Popen", Recorder)
    cluster = launcher.LocalCluster(str(tmp_path), die_with_parent=True)
    cluster.spawn("a", ["prog", "x"], "", cpus=[0, 1])
    launcher.LocalCluster(str(tmp_path)).spawn("b", ["prog", "y"], "")
    assert all(call.get("preexec_fn") is None for call in seen)
    shimmed, plain = seen[0]["argv"], seen[1]["argv"]
    assert shimmed[-2:] == ["prog", "x"] and shimmed[5:7] == [str(os.getpid()), "0,1"]  # type: ignore[index]
    assert plain == ["prog", "y"]
