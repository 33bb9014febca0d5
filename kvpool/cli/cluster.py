"""Start a kvpool cluster on this machine (127.0.0.1), as separate processes.

  kvpool cluster up                 one embedded node+directory (no etcd), in the foreground
  kvpool cluster up --nodes 3       etcd + a directory + 3 nodes (etcd from the system binary)
  kvpool cluster up --background    the same, detached; then:
  kvpool cluster up --nodes 3 --tls-cert-file cert.pem --tls-key-file key.pem   TLS control planes
  kvpool cluster status             PIDs, addresses, alive or not
  kvpool cluster down               stop it: no process and no shared-memory arena left

In the foreground Ctrl-C or SIGTERM stops everything; a child that crashes is reported with
the end of its log and the rest is stopped. Logs go to --workdir (one file per process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

STATE_NAME = "cluster.json"
BACKGROUND_START_TIMEOUT_S = 120.0
#: how long a background supervisor that did not get ready has to stop its children after
#: SIGTERM before it is SIGKILLed (its children then get SIGTERM from the kernel: they run
#: with PR_SET_PDEATHSIG, kvpool/daemon/launcher.py)
UNREADY_STOP_GRACE_S = 15.0


def default_workdir() -> str:
    return os.path.join(tempfile.gettempdir(), f"kvpool-cluster-{os.getuid()}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cluster_command", metavar="up|status|down", required=True)
    up = sub.add_parser("up", help="start the cluster")
    up.add_argument("--nodes", type=int, default=1, help="pool nodes; 1 = embedded, no etcd (default 1)")
    up.add_argument("--capacity-bytes", default="256MiB", help="host-tier capacity of each node (default 256MiB)")
    up.add_argument("--slab-bytes", default="16MiB", help="slab size of each node (default 16MiB)")
    up.add_argument("--background", action="store_true", help="detach; stop it later with 'kvpool cluster down'")
    up.add_argument(
        "--tls-cert-file", default="", help="serve TLS on every control plane with this PEM certificate (for 127.0.0.1)"
    )
    up.add_argument("--tls-key-file", default="", help="its PEM private key")
    up.add_argument("--tls-ca", default="", help="the CA that signed it (default: the certificate, self-signed)")
    for p in (up, sub.add_parser("status", help="show a background cluster"), sub.add_parser("down", help="stop it")):
        p.add_argument("--workdir", default="", help=f"logs and the state file (default {default_workdir()})")
        p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    sub.choices["down"].add_argument("--timeout-s", type=float, default=20.0, help="then SIGKILL (default 20)")


def run(args: argparse.Namespace) -> int:
    from kvpool.core.errors import KVPoolError

    workdir = args.workdir or default_workdir()
    try:
        if args.cluster_command == "up":
            return _up_background(args, workdir) if args.background else _up(args, workdir)
        if args.cluster_command == "status":
            return _status(args, workdir)
        return _down(args, workdir)
    except KVPoolError as err:
        print(f"kvpool cluster: {err}", file=sys.stderr)
        return 1


def _refuse_if_running(state_path: str) -> None:
    from kvpool.core.errors import InvalidArgument, NotFound
    from kvpool.daemon.supervise import ClusterRecord

    try:
        record = ClusterRecord.load(state_path)
    except NotFound:
        return
    if record.supervisor_alive():
        raise InvalidArgument(
            f"a cluster is already running from {record.workdir} (supervisor pid {record.supervisor_pid})",
            hint="'kvpool cluster down', or another --workdir",
        )


def _print_addresses(info: Mapping[str, object], as_json: bool) -> None:
    if as_json:
        print(json.dumps(info), flush=True)
        return
    print("kvpool cluster: up on 127.0.0.1", flush=True)
    for name in ("etcd", "directory"):
        if info.get(name):
            print(f"  {name:<10} {info[name]}", flush=True)
    nodes = info.get("nodes")
    assert isinstance(nodes, list)
    for i, address in enumerate(nodes):
        print(f"  node-{i:<5} {address}", flush=True)


def _up(args: argparse.Namespace, workdir: str) -> int:
    from kvpool.daemon.launcher import LocalCluster, PoolLayout, start_pool
    from kvpool.daemon.supervise import run_foreground
    from kvpool.rpc.credentials import load_root_certs

    os.makedirs(workdir, exist_ok=True)
    state_path = os.path.join(workdir, STATE_NAME)
    _refuse_if_running(state_path)
    layout = PoolLayout(
        args.nodes, args.capacity_bytes, args.slab_bytes, args.tls_cert_file, args.tls_key_file, args.tls_ca
    )
    root_certs = load_root_certs(layout.ca_file) if layout.tls_cert_file else None

    def start(cluster: LocalCluster) -> dict[str, object]:
        addresses = start_pool(cluster, layout)
        return {"nodes": list(addresses.nodes), "directory": addresses.directory, "etcd": addresses.etcd}

    def announce(info: dict[str, object]) -> None:
        _print_addresses(info, args.json)
        if not args.json:
            print(f"  logs       {workdir}\nCtrl-C or SIGTERM to stop", file=sys.stderr, flush=True)

    cluster = LocalCluster(workdir, die_with_parent=True, tls_root_certs=root_certs)
    status = run_foreground(cluster, start, announce, state_path)
    if not args.json:
        print("kvpool cluster: stopped", file=sys.stderr, flush=True)
    return status


def _stop_unready(child: subprocess.Popen[bytes]) -> None:
    """Stop a background supervisor that never got ready: SIGTERM (it stops its children in
    order), then SIGKILL if it has not exited by ``UNREADY_STOP_GRACE_S`` (a supervisor stuck
    where no signal handler runs: seen once, blocked in a fork; its children die with it)."""
    child.terminate()
    try:
        child.wait(UNREADY_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(5)


def _up_background(args: argparse.Namespace, workdir: str) -> int:
    from kvpool.core.errors import Unavailable
    from kvpool.daemon.launcher import log_tail
    from kvpool.daemon.supervise import ClusterRecord

    os.makedirs(workdir, exist_ok=True)
    state_path = os.path.join(workdir, STATE_NAME)
    _refuse_if_running(state_path)
    argv = [sys.executable, "-m", "kvpool.cli.main", "cluster", "up", "--nodes", str(args.nodes)]
    argv += ["--capacity-bytes", args.capacity_bytes, "--slab-bytes", args.slab_bytes, "--workdir", workdir]
    for flag, value in (("--tls-cert-file", args.tls_cert_file), ("--tls-key-file", args.tls_key_file)):
        argv += [flag, value] if value else []
    argv += ["--tls-ca", args.tls_ca] if args.tls_ca else []
    log_path = os.path.join(workdir, "supervisor.log")
    with open(log_path, "ab") as log:
        child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + BACKGROUND_START_TIMEOUT_S
    while True:
        if child.poll() is not None:
            raise Unavailable(
                f"the cluster did not start (status {child.returncode}); end of {log_path}:\n{log_tail(log_path)}"
            )
        try:
            record = ClusterRecord.load(state_path)
            if record.supervisor_pid == child.pid:
                break
        except Exception:
            pass  # not written yet (or the previous cluster's)
        if time.monotonic() > deadline:
            _stop_unready(child)
            raise Unavailable(f"the cluster did not start within {BACKGROUND_START_TIMEOUT_S} s; see {log_path}")
        time.sleep(0.1)
    _print_addresses(record.info, args.json)
    if not args.json:
        print(f"  logs       {workdir}\nstop it with: kvpool cluster down", file=sys.stderr, flush=True)
    return 0


def _status(args: argparse.Namespace, workdir: str) -> int:
    from kvpool.daemon.supervise import ClusterRecord, same_process_alive

    record = ClusterRecord.load(os.path.join(workdir, STATE_NAME))
    rows = [
        {
            "name": p["name"],
            "pid": p["pid"],
            "address": p["address"],
            "alive": same_process_alive(int(p["pid"]), p.get("start_ticks")),
        }
        for p in record.procs
    ]
    up = record.supervisor_alive() and all(r["alive"] for r in rows)
    if args.json:
        print(json.dumps({"up": up, "supervisor_pid": record.supervisor_pid, "processes": rows, **record.info}))
    else:
        print(f"kvpool cluster: {'up' if up else 'DEGRADED'} (supervisor pid {record.supervisor_pid}, {workdir})")
        for r in rows:
            print(f"  {r['name']:<10} pid {r['pid']:<8} {r['address']:<22} {'alive' if r['alive'] else 'DEAD'}")
    return 0 if up else 1


def _down(args: argparse.Namespace, workdir: str) -> int:
    from kvpool.daemon.supervise import ClusterRecord, terminate_recorded

    state_path = os.path.join(workdir, STATE_NAME)
    record = ClusterRecord.load(state_path)
    killed = terminate_recorded(record, args.timeout_s)
    Path(state_path).unlink(missing_ok=True)
    if args.json:
        print(json.dumps({"stopped": True, "killed": killed}))
    else:
        print("kvpool cluster: stopped" + (f" (SIGKILLed: {', '.join(killed)})" if killed else ""))
    return 0
