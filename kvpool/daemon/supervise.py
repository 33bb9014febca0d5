"""Run a ``LocalCluster`` in the foreground until Ctrl-C / SIGTERM or a crashed child, and
find it again from another process (``kvpool cluster status`` / ``down``) through a state file.

Why a state file with start times: ``down`` runs in another process, long after ``up``; a
PID alone may have been reused by then. Each entry records the process's start time
(``/proc/PID/stat`` field 22), and a PID is only signalled while it still names the same
process.

Guarantees (tests/integration/test_cluster_up.py):
* SIGINT or SIGTERM at any time, during start-up too, stops every child and removes the
  state file; the exit status is 0.
* A child that exits on its own is reported with the tail of its log, every other child is
  stopped, and the exit status is 1: nothing hangs waiting for a dead process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from kvpool.core.errors import NotFound
from kvpool.daemon.launcher import LocalCluster, log_tail

POLL_INTERVAL_S = 0.2
STATE_VERSION = 1


class Stopped(BaseException):
    """Raised in the main thread by SIGINT / SIGTERM (BaseException: no ``except Exception`` eats it)."""


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn the first SIGINT or SIGTERM into ``Stopped`` for the duration (main thread only);
    later ones are ignored, so a second Ctrl-C cannot break off the stop it started."""
    raised = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal raised
        if raised:
            return
        raised = True
        raise Stopped(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def process_start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot, or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    if fields[0] == "Z":
        return None  # a zombie has exited already
    return int(fields[19])


def same_process_alive(pid: int, start_ticks: int | None) -> bool:
    now = process_start_ticks(pid)
    return now is not None and (start_ticks is None or now == start_ticks)


@dataclass(frozen=True)
class ClusterRecord:
    """The state file's content: who supervises, and every child with its PID and address."""

    supervisor_pid: int
    supervisor_start_ticks: int | None
    workdir: str
    info: dict[str, Any]
    procs: list[dict[str, Any]]

    def to_json(self) -> str:
        return json.dumps({"version": STATE_VERSION, **self.__dict__}, indent=2)

    @staticmethod
    def load(path: str) -> ClusterRecord:
        try:
            obj = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise NotFound(
                f"no cluster state file at {path}", hint="start one with 'kvpool cluster up --background'"
            ) from None
        if obj.get("version") != STATE_VERSION:
            raise NotFound(f"{path} is not a kvpool cluster state file of version {STATE_VERSION}")
        return ClusterRecord(
            int(obj["supervisor_pid"]),
            obj.get("supervisor_start_ticks"),
            str(obj["workdir"]),
            dict(obj.get("info", {})),
            list(obj.get("procs", [])),
        )

    def supervisor_alive(self) -> bool:
        return same_process_alive(self.supervisor_pid, self.supervisor_start_ticks)


def write_state(path: str, cluster: LocalCluster, info: dict[str, Any]) -> None:
    """Write the state file atomically (a reader never sees half of it)."""
    procs = []
    for p in cluster.describe():
        pid = p["pid"]
        assert isinstance(pid, int)
        procs.append({**p, "start_ticks": process_start_ticks(pid)})
    record = ClusterRecord(os.getpid(), process_start_ticks(os.getpid()), cluster.workdir, info, procs)
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(record.to_json())
    os.replace(tmp, path)


def supervise(
    cluster: LocalCluster,
    out: TextIO = sys.stderr,
    survivable: Callable[[str], bool] = lambda name: False,
    poll_interval_s: float = POLL_INTERVAL_S,
) -> int:
    """Block until a signal (-> 0) or a crashed child (-> 1, reported on ``out``). A child
    whose name is ``survivable`` (a demo's engine: the router fails its requests and goes
    on) is reported once and the rest keeps running. The caller stops the cluster (in a
    ``finally``), so a signal during this call and one before it end alike."""
    reported: set[int] = set()
    try:
        while True:
            for proc in cluster.crashed():
                if proc.popen.pid in reported:
                    continue
                reported.add(proc.popen.pid)
                fatal = not survivable(proc.name)
                print(
                    f"kvpool: {proc.name} (pid {proc.popen.pid}) exited with status {proc.popen.returncode}; "
                    + ("stopping the others" if fatal else "the others go on")
                    + f". End of {proc.log_path}:\n{log_tail(proc.log_path)}",
                    file=out,
                    flush=True,
                )
                if fatal:
                    return 1
            time.sleep(poll_interval_s)
    except Stopped as sig:
        print(f"kvpool: {sig}: stopping {len(cluster.procs)} processes", file=out, flush=True)
        return 0


def run_foreground(
    cluster: LocalCluster,
    start: Callable[[LocalCluster], dict[str, Any]],
    announce: Callable[[dict[str, Any]], None],
    state_path: str = "",
    out: TextIO = sys.stderr,
    survivable: Callable[[str], bool] = lambda name: False,
) -> int:
    """``start`` the cluster's processes, write the state file, ``announce`` what started,
    then ``supervise``; every child is stopped and the state file removed however it ends
    (a signal during start-up included). The exit status of ``supervise``, or 1 when
    ``start`` failed (its error printed)."""
    from kvpool.core.errors import KVPoolError

    status = 0
    try:
        with stop_on_signals():
            try:
                info = start(cluster)
                if state_path:
                    write_state(state_path, cluster, info)
                announce(info)
                status = supervise(cluster, out, survivable)
            except Stopped:
                status = 0
            except KVPoolError as err:
                print(f"kvpool: {err}", file=out, flush=True)
                status = 1
            finally:
                cluster.stop()
    finally:
        if state_path:
            Path(state_path).unlink(missing_ok=True)
    return status


def terminate_recorded(record: ClusterRecord, timeout_s: float) -> list[str]:
    """Stop a cluster from outside: SIGTERM its supervisor (which stops its children) and wait;
    whatever is still alive after ``timeout_s`` is SIGKILLed, and arenas left behind removed.
    Returns the names of processes that had to be killed."""
    if record.supervisor_alive():
        os.kill(record.supervisor_pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s

    def alive() -> list[dict[str, Any]]:
        return [p for p in record.procs if same_process_alive(int(p["pid"]), p.get("start_ticks"))]

    while (record.supervisor_alive() or alive()) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = []
    if record.supervisor_alive():
        os.kill(record.supervisor_pid, signal.SIGKILL)
        killed.append("supervisor")
    for p in alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(p["pid"]), signal.SIGKILL)
        killed.append(str(p["name"]))
    for p in record.procs:
        arena = str(p.get("arena_path", ""))
        if arena:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(arena)
    return killed
