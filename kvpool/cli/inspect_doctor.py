"""``kvpool inspect doctor``: check what a pool needs and say what to fix.

Each check gives ok / warn / fail / skip, what it found and, unless ok, what to do:
  config        the effective daemon config (flags are not read here: --config FILE.toml,
                KVPOOL_* env) parses and validates
  daemon        the daemon at --address answers Stats (and which node it is)
  arena         the arena directory exists, is writable, and is tmpfs with room for capacity
  memory        MemAvailable (plus the running daemon's own arena) covers capacity_bytes
  arena pages   which pages the running daemon's arena is on (huge or 4 KiB), else whether
                the host has the huge pages --arena-huge-pages asks for
  local calls   whether the daemon offers its same-host call socket and this user can reach it
                (else its clients' calls go through gRPC, several times slower)
  copy kernel   whether copies and checksums run in one pass (the native kernel, AVX2 where
                the CPU has it) or on the slower numpy + xxhash path (no C compiler at install)
  disk tier     when configured: the directory is writable and has room for its capacity
  etcd          when configured: each endpoint answers GET /health
  ucx           ucxx imports, and the UCX components it would use (tcp, shared memory, RDMA)
  nixl          nixl-cu12 imports, which of its backends (UCX, POSIX, GDS, ...) can start here,
                and whether NIXL reads land straight in the caller's rows or are staged (RDMA)
The exit code is 1 when any check fails, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from rich.table import Table

from kvpool.cli.inspect import address_of, open_admin
from kvpool.cli.inspect_render import human_bytes, make_console
from kvpool.core.checksum import native_kernel
from kvpool.core.config import DaemonConfig
from kvpool.core.errors import KVPoolError
from kvpool.core.unix_path import socket_address
from kvpool.storage.arena import HugePageRoom
from kvpool.storage.thp import LOW_HUGE_SHARE, THP_ON_COMMAND, ShmemThp

ETCD_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str
    fix: str = ""


def _config(args: argparse.Namespace) -> tuple[Check, DaemonConfig]:
    from kvpool.daemon.config_loader import environ, load_config

    path = args.config or os.environ.get("KVPOOL_CONFIG")
    parsed = argparse.Namespace(config=args.config)
    try:
        config = load_config(parsed, environ())
    except KVPoolError as err:
        return Check("config", "fail", err.message, err.hint or "fix the file or the KVPOOL_* variable it names"), (
            DaemonConfig()
        )
    source = path or "built-in defaults and KVPOOL_* environment"
    detail = f"{source}: listen {config.listen}, capacity {human_bytes(config.store.capacity_bytes)}"
    return Check("config", "ok", detail), config


def _daemon(args: argparse.Namespace) -> tuple[Check, dict[str, Any] | None]:
    address = address_of(args)
    try:
        with open_admin(args, address) as admin:
            stats = admin.stats()
    except KVPoolError as err:
        return Check("daemon", "fail", f"{address}: {err.message}", err.hint or "start it: kvpool serve"), None
    used = f"{human_bytes(stats.get('used_bytes', 0))} of {human_bytes(stats.get('capacity_bytes', 0))} used"
    return Check("daemon", "ok", f"{address}: node {stats.get('node_id', '?')}, {used}"), stats


def _fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (from /proc/mounts), or ""."""
    try:
        with open("/proc/mounts", encoding="utf-8") as fh:
            mounts = [line.split()[:3] for line in fh]
    except OSError:
        return ""
    real = os.path.realpath(path)
    best = ("", "")
    for _, mount_point, fs in mounts:
        if (real == mount_point or real.startswith(mount_point.rstrip("/") + "/")) and len(mount_point) > len(best[0]):
            best = (mount_point, fs)
    return best[1]


def _directory(name: str, path: str, need_bytes: int, running: bool, want_tmpfs: bool) -> Check:
    if not os.path.isdir(path):
        return Check(
            name, "fail", f"{path} does not exist", f"create it (mkdir -p {path}) or point the option elsewhere"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        return Check(
            name, "fail", f"{path} is not writable by uid {os.getuid()}", f"chown/chmod {path}, or use another"
        )
    free = shutil.disk_usage(path).free
    fs = _fs_type(path)
    detail = f"{path} ({fs or 'unknown fs'}): {human_bytes(free)} free, {human_bytes(need_bytes)} configured"
    if want_tmpfs and fs and fs not in ("tmpfs", "hugetlbfs"):
        return Check(name, "warn", detail, "use a tmpfs (e.g. /dev/shm) so same-host clients map memory, not disk")
    if free < need_bytes and not running:
        return Check(name, "fail", detail, "free space, lower the capacity, or pick another directory")
    return Check(name, "ok", detail)


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _memory(config: DaemonConfig, stats: dict[str, Any] | None) -> Check:
    available = _mem_available_bytes()
    if not available:
        return Check("memory", "skip", "no /proc/meminfo")
    need = config.store.capacity_bytes
    reserved = int(stats.get("capacity_bytes", 0)) if stats else 0  # a running daemon already holds its arena
    detail = f"MemAvailable {human_bytes(available)}; capacity {human_bytes(need)}"
    if reserved:
        detail += f" (the running daemon holds {human_bytes(reserved)} already)"
    if need > available + reserved:
        return Check(
            "memory", "fail", detail, "lower --capacity-bytes, or free memory (the arena is reserved at start)"
        )
    if need > 0.8 * (available + reserved):
        return Check("memory", "warn", detail, "little room is left for engines and clients: consider a smaller arena")
    return Check("memory", "ok", detail)


def _arena_pages(config: DaemonConfig, stats: dict[str, Any] | None, room: HugePageRoom, thp: ShmemThp) -> Check:
    """Huge pages or 4 KiB pages: what the running daemon got, or what a start would get
    (reserved huge pages, ``room``; transparent ones of shared memory, ``thp``)."""
    need = room.pages_for(config.store.capacity_bytes)
    host = (
        f"host: {room.free_pages} of {room.total_pages} huge pages of {human_bytes(room.page_bytes)} free, "
        f"transparent ones for shared memory {'on' if thp.usable else 'off'} ({thp.describe()})"
    )
    reserve = (
        f"reserve them as root: echo {room.total_pages - room.free_pages + need} > /proc/sys/vm/nr_hugepages, "
        f"then restart the daemon with --arena-huge-pages on; or, with nothing reserved, {THP_ON_COMMAND} "
        "and --arena-huge-pages thp"
    )
    page_bytes = int(stats.get("arena_page_bytes", 0)) if stats else 0
    asked = str(stats.get("arena_huge_pages", "off")) if stats else config.arena_huge_pages
    if page_bytes > 4096 and stats and stats.get("arena_transparent"):
        capacity = max(1, int(stats.get("capacity_bytes", 0)) or config.store.capacity_bytes)
        share = min(1.0, int(stats.get("arena_huge_bytes", 0)) / capacity)
        detail = f"the daemon's arena is on transparent huge pages of {human_bytes(page_bytes)}: {share:.0%} of it"
        if share < LOW_HUGE_SHARE:
            return Check(
                "arena pages",
                "warn",
                f"{detail} (memory was fragmented at start); {host}",
                "restart the daemon when more memory is free, or reserve huge pages (--arena-huge-pages on)",
            )
        return Check("arena pages", "ok", f"{detail}; {host}")
    if page_bytes > 4096:
        return Check("arena pages", "ok", f"the daemon's arena is on huge pages of {human_bytes(page_bytes)}; {host}")
    # asked for 4 KiB pages where the host would give transparent huge pages without reserving anything
    offer = "--arena-huge-pages thp would put the arena on the transparent huge pages this host gives"
    offer = offer if thp.usable else ""
    if page_bytes:
        detail = f"the daemon's arena is on 4 KiB pages (--arena-huge-pages {asked}"
        if asked == "off":
            return Check("arena pages", "ok", f"{detail}); {host}", offer)
        return Check("arena pages", "warn", f"{detail} fell back); {host}", reserve)
    if asked == "off":
        return Check("arena pages", "ok", f"4 KiB pages (--arena-huge-pages off); {host}", offer)
    reserved_ok = bool(room.page_bytes) and room.free_pages >= need
    if asked in ("on", "try") and reserved_ok:
        return Check("arena pages", "ok", f"huge pages: the arena needs {need}; {host}")
    if asked in ("thp", "try") and thp.usable:
        return Check("arena pages", "ok", f"transparent huge pages of shared memory; {host}")
    status = "warn" if asked == "try" else "fail"
    what = "transparent huge pages" if asked == "thp" else f"{need} huge pages"
    return Check("arena pages", status, f"the arena needs {what}; {host}", reserve)


def _etcd(endpoints: list[str]) -> Check:
    if not endpoints:
        return Check("etcd", "skip", "not configured (single machine: no etcd needed)")
    bad = []
    for endpoint in endpoints:
        url = endpoint if "://" in endpoint else f"http://{endpoint}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=ETCD_TIMEOUT_S) as reply:
                healthy = json.loads(reply.read() or b"{}").get("health") in ("true", True)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            bad.append(f"{endpoint} ({getattr(exc, 'reason', exc)})")
            continue
        if not healthy:
            bad.append(f"{endpoint} (unhealthy)")
    if bad:
        return Check("etcd", "fail", "unreachable: " + ", ".join(bad), "start etcd, or fix --etcd / [cluster] etcd")
    return Check("etcd", "ok", f"{len(endpoints)} endpoints healthy: {', '.join(endpoints)}")


def _ucx(config: DaemonConfig) -> Check:
    import importlib.util
    import re

    wanted = config.cluster.transport == "ucx"
    if importlib.util.find_spec("ucxx") is None:
        status = "fail" if wanted else "skip"
        return Check(
            "ucx", status, "ucxx is not installed: the data plane uses TCP sockets", "pip install 'kvpool[ucx]'"
        )
    try:
        import ucxx._lib.libucxx as ucx_api  # type: ignore[import-untyped]

        context = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG,))
        components = sorted(set(re.findall(r"md \d+\s*:\s*component \d+\s+(\S+)", context.info)))
        tls = context.config.get("TLS", "")
    except Exception as exc:  # a broken UCX install must not crash the doctor
        return Check("ucx", "fail", f"ucxx does not start: {exc}", "check the UCX install (ucx_info -v)")
    rdma = [c for c in components if c in ("ib", "rdmacm", "gga", "rocm", "cuda_ipc")]
    detail = f"components {', '.join(components)}; UCX_TLS={tls}; " + (
        "RDMA: " + ", ".join(rdma) if rdma else "no RDMA"
    )
    return Check("ucx", "ok", detail)


def _nixl(config: DaemonConfig) -> Check:
    """Which NIXL backends this host can start: shipping a plugin is not being usable (GDS needs
    cuFile and a GPU, OBJ an object store); ``--transport nixl`` needs UCX."""
    from kvpool.transport import nixl_agent

    wanted = config.cluster.transport == "nixl"
    why = nixl_agent.nixl_available()
    if why:
        return Check(
            "nixl",
            "fail" if wanted else "skip",
            f"nixl-cu12 does not import ({why}): --transport nixl is unavailable",
            "pip install 'kvpool[nixl]' (or pip install --no-deps nixl-cu12==1.5.1)",
        )
    try:
        backends = nixl_agent.usable_backends()
    except Exception as exc:  # a broken NIXL install must not crash the doctor
        return Check("nixl", "fail", f"NIXL does not start: {exc}", "check the nixl-cu12 install")
    usable = [name for name, reason in backends.items() if not reason]
    unusable = [f"{name} ({reason.splitlines()[0][:60]})" for name, reason in backends.items() if reason]
    reads = "reads staged (RDMA devices present)" if nixl_agent.has_rdma() else "reads land in the caller's rows"
    detail = f"usable backends: {', '.join(usable) or 'none'}; not usable: {', '.join(unusable) or 'none'}; {reads}"
    if "UCX" not in usable:
        return Check("nixl", "fail" if wanted else "warn", detail, "--transport nixl needs the UCX backend")
    return Check("nixl", "ok", detail)


def _local_calls(stats: dict[str, Any] | None) -> Check:
    """Whether same-host clients make their control calls over the daemon's Unix socket
    (kvpool.rpc.local_call): offered, and reachable by this user."""
    if stats is None:
        return Check("local calls", "skip", "no daemon answered")
    path = str(stats.get("local_socket", ""))
    if not path:
        return Check("local calls", "ok", "off (--local-calls off): same-host clients call over gRPC")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with socket_address(path) as address:
            conn.connect(address)
    except OSError as exc:
        return Check(
            "local calls",
            "warn",
            f"{path}: this user cannot connect ({exc.strerror or exc}): its clients call over gRPC (slower)",
            "run clients as the daemon's user, or widen the socket with --arena-socket-mode 660 / 666 "
            "(a token is still needed with --credentials)",
        )
    finally:
        conn.close()
    return Check("local calls", "ok", f"{path}: same-host clients make their control calls here")


def _copy_kernel(kernel: str | None) -> Check:
    """The one-pass copy + checksum of this install (kvpool/core/checksum.py): the daemon's
    commit verification and every same-host client of this install use it."""
    if kernel == "avx2":
        return Check("copy kernel", "ok", "one pass (native, AVX2): a verified read runs at copy speed")
    if kernel == "scalar":
        return Check("copy kernel", "ok", "one pass (native, portable C: this CPU has no AVX2)")
    return Check(
        "copy kernel",
        "warn",
        "numpy + xxhash (the native kernel was not built): verified reads and puts are slower",
        "install gcc and the Python headers, then reinstall kvpool (bash tools/dev.sh setup)",
    )


def run_checks(args: argparse.Namespace) -> list[Check]:
    # probing NIXL's backends starts the ones that cannot run here (OBJ, GDS, ...): their C++
    # errors would land on the terminal above the table, which already says what failed and why
    os.environ.setdefault("NIXL_LOG_LEVEL", "FATAL")
    config_check, config = _config(args)
    daemon_check, stats = _daemon(args)
    running = stats is not None
    checks = [config_check, daemon_check]
    checks.append(_directory("arena", config.arena_dir, config.store.capacity_bytes, running, want_tmpfs=True))
    checks.append(_memory(config, stats))
    checks.append(_arena_pages(config, stats, HugePageRoom.measure(), ShmemThp.measure()))
    checks.append(_local_calls(stats))
    checks.append(_copy_kernel(native_kernel()))
    if config.tiers.disk_dir:
        checks.append(_directory("disk tier", config.tiers.disk_dir, config.tiers.disk_capacity_bytes, running, False))
    else:
        checks.append(Check("disk tier", "skip", "no --disk-dir: host memory only"))
    etcd = args.etcd if args.etcd is not None else config.cluster.etcd
    checks.append(_etcd([e.strip() for e in etcd.split(",") if e.strip()]))
    checks.append(_ucx(config))
    checks.append(_nixl(config))
    return checks


STYLE: dict[str, str] = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def doctor(args: argparse.Namespace, checks_of: Callable[[argparse.Namespace], list[Check]] = run_checks) -> int:
    checks = checks_of(args)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        table = Table(title="kvpool doctor", title_justify="left")
        for column in ("check", "status", "found", "fix"):
            table.add_column(column, overflow="fold")
        for c in checks:
            table.add_row(c.name, f"[{STYLE[c.status]}]{c.status}[/]", c.detail, c.fix)
        make_console().print(table)
    return 1 if any(c.status == "fail" for c in checks) else 0
