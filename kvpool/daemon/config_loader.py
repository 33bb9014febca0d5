"""Daemon configuration from flags, ``KVPOOL_*`` environment variables and a TOML file.

Precedence: command-line flag > environment variable > TOML file > built-in default.
Each option has one row in ``OPTIONS``: its flag, its place in ``DaemonConfig`` and its
help text. One name per option: the flag ``--host-name`` is the environment variable
``KVPOOL_HOST_NAME`` and the TOML key ``host_name`` (in the table of its section:
``capacity_bytes`` under ``[store]``, ``disk_dir`` under ``[tiers]``, ``host_name`` under
``[cluster]``, ``listen`` at the top). ``kvpool serve --print-config`` prints every key with
its effective value and where it came from; docs/kvpool.example.toml is that output for the
defaults. Sizes accept suffixes: 512MiB, 2GiB, 1G.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.core.config import DaemonConfig
from kvpool.core.errors import InvalidArgument

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def parse_switch(text: str | bool) -> bool:
    """A yes/no option: a TOML boolean, or 1/true/yes/on and 0/false/no/off in env and flags."""
    if isinstance(text, bool):
        return text
    word = str(text).strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise InvalidArgument(f"{text!r} is not a yes/no value", hint="write true or false (1/0, yes/no, on/off)")


def parse_on_off(text: str | bool) -> bool:
    """A yes/no option that is on by default, so its flag takes a value (``--local-calls off``)."""
    return parse_switch(text)


def parse_octal(text: str | int) -> int:
    """A file mode: '600', '0660', '0o666' (or an int from TOML)."""
    if isinstance(text, int):
        return text
    try:
        return int(text.strip().removeprefix("0o"), 8)
    except ValueError:
        raise InvalidArgument(f"{text!r} is not an octal file mode like 600") from None


def parse_bytes(text: str | int) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '4096' -> 4096."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise InvalidArgument(f"{text!r} is not a size", hint="write e.g. 4096, 512MiB or 2GiB")
    number, unit = match.groups()
    unit = (unit or "").lower().rstrip("b")
    return int(float(number) * _UNITS[unit])


@dataclass(frozen=True)
class Option:
    """One daemon option. ``help`` says what it does, never its default: the default is
    read from ``DaemonConfig`` (``default_help``), so it is written once, in core/config.py.
    ``default_means`` says what an empty or off default does, or qualifies a value
    ("no quota")."""

    flag: str
    path: str  # dotted path in DaemonConfig
    parse: Callable[[Any], Any]
    help: str
    default_means: str = ""

    @property
    def env(self) -> str:
        return "KVPOOL_" + self.flag.lstrip("-").replace("-", "_").upper()

    @property
    def dest(self) -> str:
        return self.path.replace(".", "__")

    @property
    def section(self) -> str:
        """The TOML table of the option ("" = top level)."""
        return self.path.rpartition(".")[0]

    @property
    def key(self) -> str:
        """The dotted TOML key: the section and the flag's name with underscores."""
        leaf = self.flag.lstrip("-").replace("-", "_")
        return f"{self.section}.{leaf}" if self.section else leaf


OPTIONS: list[Option] = [
    Option(
        "--listen",
        "listen",
        str,
        "gRPC control-plane address, HOST:PORT (keep it on 127.0.0.1 unless the host is firewalled).",
    ),
    Option("--node-id", "node_id", str, "name of this node in events and stats.", default_means="the listen address"),
    Option(
        "--arena-dir",
        "arena_dir",
        str,
        "directory of the shared-memory arena file; must be tmpfs (e.g. /dev/shm) so same-host clients map it.",
    ),
    Option(
        "--capacity-bytes",
        "store.capacity_bytes",
        parse_bytes,
        "host-tier capacity (arena size), e.g. 8GiB. Must fit in available memory and in "
        "the free space of --arena-dir (else the daemon refuses to start); reserved in full at start.",
    ),
    Option(
        "--slab-bytes",
        "store.slab_bytes",
        parse_bytes,
        "slab size of the allocator; must hold one block.",
    ),
    Option(
        "--high-watermark",
        "store.high_watermark",
        float,
        "evict when a put would take usage above this fraction of capacity.",
    ),
    Option("--low-watermark", "store.low_watermark", float, "...evicting down to this fraction."),
    Option(
        "--lease-ttl-ms",
        "store.lease_ttl_ms",
        int,
        "a read lease not released within this many ms is dropped (its blocks become evictable again).",
    ),
    Option(
        "--put-ttl-ms",
        "store.put_ttl_ms",
        int,
        "a put not committed within this many ms is reclaimed (its writer is presumed dead).",
    ),
    Option("--max-batch-blocks", "store.max_batch_blocks", int, "most blocks one call may name."),
    Option("--max-leases", "store.max_leases", int, "most read leases held at once."),
    Option("--max-pending-puts", "store.max_pending_puts", int, "most puts in flight at once."),
    Option(
        "--allow-overcommit",
        "store.allow_overcommit",
        parse_switch,
        "start even when --capacity-bytes exceeds the memory available (MemAvailable) or the free "
        "space of --arena-dir: logs a warning and leaves the arena unreserved, so clients may die with "
        "SIGBUS when the machine runs out. A switch (no value); env/TOML take true/false.",
        default_means="refuse to start",
    ),
    Option(
        "--max-pin-ttl-ms",
        "store.max_pin_ttl_ms",
        int,
        "longest soft pin in ms (one day); renew a pin to keep it longer.",
    ),
    Option(
        "--client-put-verify-one-in",
        "store.client_put_verify_one_in",
        int,
        "the daemon re-checksums one block in N of a same-host client's put at commit, chosen at "
        "random (at least one per put; all of the put once one fails). The client checksums every "
        "block in the pass that copies it and every reader verifies every block, so a bad block is "
        "a miss, never wrong KV; 1 re-checks every block (a put's bytes read a second time: about a "
        "third of its time). Blocks from peers and the disk are always checked in full.",
    ),
    Option("--host-policy", "tiers.host_policy", str, "eviction policy of the host tier."),
    Option(
        "--disk-dir",
        "tiers.disk_dir",
        str,
        "directory of the disk tier's slab files (NVMe); empty = no disk tier.",
    ),
    Option("--disk-capacity-bytes", "tiers.disk_capacity_bytes", parse_bytes, "disk tier capacity."),
    Option(
        "--disk-slab-file-bytes",
        "tiers.disk_slab_file_bytes",
        parse_bytes,
        "size of each preallocated slab file.",
    ),
    Option("--disk-policy", "tiers.disk_policy", str, "eviction policy of the disk tier."),
    Option(
        "--disk-high-watermark",
        "tiers.disk_high_watermark",
        float,
        "a disk write that would take usage above this fraction of the disk capacity first evicts.",
    ),
    Option(
        "--disk-low-watermark",
        "tiers.disk_low_watermark",
        float,
        "...evicting down to this fraction (by --disk-policy).",
    ),
    Option(
        "--disk-admission",
        "tiers.disk_admission",
        str,
        "'all' or 'second-hit' (skip one-hit blocks on disk).",
    ),
    Option("--disk-io-threads", "tiers.disk_io_threads", int, "threads doing disk I/O."),
    Option(
        "--write-behind-queue-blocks",
        "tiers.write_behind_queue_blocks",
        int,
        "bound of the host->disk write-behind queue, in blocks.",
    ),
    Option(
        "--shutdown-flush-ms",
        "tiers.shutdown_flush_ms",
        int,
        "on SIGTERM, write the host blocks the disk tier lacks to it for at most this long (0: off).",
    ),
    Option(
        "--device-capacity-bytes",
        "tiers.device_capacity_bytes",
        parse_bytes,
        "device (HBM) tier capacity; 0 = none.",
    ),
    Option("--device-policy", "tiers.device_policy", str, "eviction policy of the device tier."),
    Option(
        "--device",
        "tiers.device",
        str,
        "torch device of the device (HBM) tier, e.g. cuda or cuda:1.",
    ),
    Option(
        "--device-high-watermark",
        "tiers.device_high_watermark",
        float,
        "a copy to HBM that would take usage above this fraction of the device capacity first evicts.",
    ),
    Option(
        "--device-low-watermark",
        "tiers.device_low_watermark",
        float,
        "...evicting (demoting) down to this fraction.",
    ),
    Option("--grpc-workers", "grpc_workers", int, "threads serving control-plane calls."),
    Option("--max-message-bytes", "max_message_bytes", parse_bytes, "largest gRPC message."),
    Option(
        "--sweep-interval-ms",
        "sweep_interval_ms",
        int,
        "how often expired leases and dead puts are reclaimed.",
    ),
    Option("--log-level", "log_level", str, "DEBUG, INFO, WARNING or ERROR."),
    Option(
        "--namespace-quota-bytes",
        "store.namespace_quota_bytes",
        parse_bytes,
        "most host-tier bytes one namespace may hold, e.g. 1GiB; a put past it evicts that "
        "namespace's own least recently used blocks first.",
        default_means="no quota",
    ),
    Option(
        "--admin-views",
        "admin_views",
        str,
        "all-namespace views (Snapshot/Events of every tenant, the Stats namespace list): "
        "'loopback' (served only on a loopback --listen), 'on' or 'off'. See docs/security.md.",
    ),
    Option(
        "--credentials",
        "credentials_file",
        str,
        "credentials file (JSON, or TOML if it ends in .toml): tenants' and admins' token sha256s, "
        "the namespace digests each tenant may use, the cluster token's sha256. Every call then needs "
        "'authorization: Bearer TOKEN'. See docs/security.md.",
        default_means="none (allowed only on a loopback --listen)",
    ),
    Option(
        "--tls-cert-file",
        "tls_cert_file",
        str,
        "PEM certificate chain for TLS on the control-plane listener.",
        default_means="none (plaintext)",
    ),
    Option("--tls-key-file", "tls_key_file", str, "PEM private key of --tls-cert-file.", default_means="none"),
    Option(
        "--arena-handoff",
        "arena_handoff",
        str,
        "how same-host clients get the arena: 'file' (a 0600 file in --arena-dir, opened by path), "
        "'fd' (an anonymous memfd handed over a Unix socket after the token, read-only unless the "
        "client holds a put), 'auto' (fd when --credentials is set).",
    ),
    Option(
        "--arena-huge-pages",
        "arena_huge_pages",
        str,
        "put the arena on huge pages: 'on' (the host's reserved ones, MFD_HUGETLB; reserve them as "
        "root: echo N > /proc/sys/vm/nr_hugepages, N = capacity / 2 MiB; refuse to start without "
        "enough free), 'thp' (transparent huge pages of shared memory, nothing reserved; needs "
        "/sys/kernel/mm/transparent_hugepage/shmem_enabled set to advise, within_size, always or force; "
        "refuse to start otherwise), 'try' (reserved ones, else transparent ones, else 4 KiB pages "
        "with a warning), 'off'. Copies out of a huge-page arena run at private-memory speed, and "
        "puts without protection keys switch 512x fewer page entries; a put's writable window then "
        "covers whole 2 MiB pages. Needs the memfd hand-off ('auto' becomes fd). See docs/tiers.md.",
    ),
    Option(
        "--arena-segment-bytes",
        "arena_segment_bytes",
        parse_bytes,
        "per-tenant arenas (with --credentials and the memfd hand-off): the arena is made of "
        "segments of this size, each owned by one tenant group at a time; a client maps only its "
        "tenants' segments. A multiple of --slab-bytes and of 2 MiB. See docs/security.md.",
        default_means="auto: capacity / 16, at most 64 MiB",
    ),
    Option(
        "--arena-socket-mode",
        "arena_socket_mode",
        parse_octal,
        "file mode (octal) of the arena hand-off and local-call sockets: 600 admits clients of the "
        "daemon's uid only; 660 or 666 admits other uids (each still needs a token).",
    ),
    Option(
        "--local-calls",
        "local_calls",
        parse_on_off,
        "also answer same-host clients' control calls (lookup, lease, put) over a Unix socket in "
        "--arena-dir: the same handlers, token and tenant limits as gRPC at about a third of its "
        "latency; clients that cannot reach it use gRPC: 'on' or 'off'. See docs/security.md.",
    ),
    Option(
        "--gc-freeze",
        "gc_freeze",
        parse_on_off,
        "keep the block index out of Python's full garbage collections: after each one, the "
        "objects that survived it are frozen, so the next walks only newer ones (a filling pool "
        "of a million blocks otherwise stalls ~0.2 s per full collection, more as it grows): "
        "'on' or 'off'. See docs/operations.md.",
    ),
    Option(
        "--gc-full-interval-s",
        "gc_full_interval_s",
        int,
        "with --gc-freeze on, one collection over everything (frozen objects too) this often, to "
        "reclaim reference cycles among objects that died after they were frozen; it pauses the "
        "daemon as long as an unfrozen full collection, and is logged. 0 = never: memory held by "
        "such cycles then grows without bound. Ignored with --gc-freeze off.",
    ),
    Option(
        "--protect-process",
        "protect_process",
        str,
        "make the daemon non-dumpable (prctl PR_SET_DUMPABLE 0), so other processes of its uid cannot "
        "open /proc/PID/fd (the arena), /proc/PID/mem or ptrace it, and it leaves no core dump: "
        "'on', 'off' or 'auto' (on with --credentials).",
    ),
    Option(
        "--insecure",
        "insecure",
        parse_switch,
        "allow a non-loopback --listen / --data-listen without credentials and TLS (a trusted, "
        "firewalled network only).",
        default_means="off",
    ),
    Option(
        "--tenant-budget-units",
        "tenant_budget_units",
        int,
        "per-tenant fairness: cost units one tenant may have in flight (a call costs 1 + its hashes, "
        "lease ids or checksums / 1024); a call over it waits --tenant-wait-ms, then TENANT_BUSY. "
        "0 = off. See docs/security.md.",
    ),
    Option(
        "--tenant-rate-units-per-s",
        "tenant_rate_units_per_s",
        int,
        "per-tenant fairness: cost units one tenant may spend per second (bursts of one budget pass at once); "
        "a call past it waits up to --tenant-wait-ms for tokens, then TENANT_BUSY. 0 = no rate.",
    ),
    Option(
        "--tenant-walk-cost-items",
        "tenant_walk_cost_items",
        int,
        "per-tenant fairness: each block a Lookup or Lease finds costs this many hashes more, billed to "
        "the tenant's rate after the call (a hit walk costs far more than the hashes a request carries). "
        "0 = bill calls by their request size only.",
    ),
    Option(
        "--tenant-call-cost-items",
        "tenant_call_cost_items",
        int,
        "per-tenant fairness: every call also costs this many hashes against the tenant's rate (the "
        "work of receiving and answering it), so a flood of small calls is rate-limited too. "
        "0 = calls under 1,024 hashes are never rate-limited.",
    ),
    Option(
        "--tenant-max-calls",
        "tenant_max_calls",
        int,
        "worker threads one tenant may hold at once (calls in flight and waiting).",
        default_means="half of --grpc-workers",
    ),
    Option(
        "--tenant-wait-ms",
        "tenant_wait_ms",
        int,
        "how long a call over its tenant's budget or rate waits for room before TENANT_BUSY.",
    ),
    Option(
        "--tenant-data-inflight-bytes",
        "tenant_data_inflight_bytes",
        parse_bytes,
        "per-tenant fairness on the TCP data plane: bytes of READ / WRITE transfers one tenant may have "
        "in flight at once (a transfer alone always runs); past it a transfer waits --tenant-wait-ms, then "
        "is answered BUSY (a miss for the reader). 0 = ungated.",
    ),
    Option(
        "--tenant-data-transfers",
        "tenant_data_transfers",
        int,
        "per-tenant fairness on the TCP data plane: transfers one tenant may have running or waiting at once.",
    ),
    Option(
        "--max-namespaces",
        "max_namespaces",
        int,
        "namespaces registered at once; when full, namespaces without blocks are retired, least recently used first.",
    ),
    Option(
        "--namespace-idle-ms",
        "namespace_idle_ms",
        int,
        "a namespace with no stored block and no call for this long is retired.",
    ),
    Option(
        "--metrics-listen",
        "metrics_listen",
        str,
        "serve Prometheus metrics (GET /metrics) on this HOST:PORT, e.g. 127.0.0.1:9450; a host off "
        "loopback needs --insecure (metrics carry no authentication). See docs/metrics.md.",
        default_means="off",
    ),
    Option(
        "--directory",
        "cluster.directory",
        str,
        "cluster mode: comma-separated directory addresses "
        "(HOST:PORT,...); the node registers with the leader and streams its KV events.",
        default_means="none",
    ),
    Option(
        "--etcd",
        "cluster.etcd",
        str,
        "cluster mode: comma-separated etcd endpoints; the node keeps a "
        "liveness lease there and finds the directory leader through it.",
        default_means="none",
    ),
    Option("--cluster", "cluster.cluster", str, "cluster name (etcd key prefix)."),
    Option(
        "--data-listen",
        "cluster.data_listen",
        str,
        "data-plane address peers read blocks from, HOST:PORT.",
        default_means="127.0.0.1 on a free port when --directory/--etcd is set, else no data plane",
    ),
    Option(
        "--cluster-token-file",
        "cluster.token_file",
        str,
        "file holding the cluster token this node presents to a directory with credentials "
        "(its sha256 is [cluster] token_sha256 there).",
        default_means="none",
    ),
    Option(
        "--directory-tls-ca",
        "cluster.directory_tls_ca",
        str,
        "PEM CA certificate of a directory that serves TLS (its --tls-cert-file, or the CA that signed "
        "it): the node then dials the directory over TLS. See docs/security.md.",
        default_means="none (plaintext)",
    ),
    Option("--transport", "cluster.transport", str, "data plane between nodes: tcp, ucx or nixl (docs/cluster.md)."),
    Option(
        "--data-tls",
        "cluster.data_tls",
        parse_switch,
        "TLS on the TCP data plane with --tls-cert-file / --tls-key-file: KV bytes are encrypted and "
        "authenticated on the wire, at a cost in throughput (docs/security.md). UCX / NIXL bytes are not.",
        default_means="off",
    ),
    Option(
        "--host-name",
        "cluster.host",
        str,
        "host name used to decide same-host (shared-memory) access.",
        default_means="the machine's host name",
    ),
    Option(
        "--heartbeat-interval-ms",
        "cluster.heartbeat_interval_ms",
        int,
        "heartbeat period to the directory.",
    ),
    Option("--liveness-ttl-s", "cluster.liveness_ttl_s", int, "etcd lease TTL of the node's liveness key."),
    Option(
        "--kv-events-endpoint",
        "cluster.kv_events_endpoint",
        str,
        "publish KV events in vLLM's format (msgpack over ZMQ PUB) on this endpoint, e.g. tcp://127.0.0.1:5557.",
        default_means="off",
    ),
    Option("--kv-events-topic", "cluster.kv_events_topic", str, "ZMQ topic of those events."),
    Option(
        "--kv-events-replay-endpoint",
        "cluster.kv_events_replay_endpoint",
        str,
        "ZMQ ROUTER endpoint that replays buffered event batches to subscribers that saw a gap (vLLM's protocol).",
        default_means="off",
    ),
]


def config_default(path: str, config: DaemonConfig | None = None) -> Any:
    """The value at a dotted ``DaemonConfig`` path (``store.capacity_bytes``)."""
    value: Any = config if config is not None else DaemonConfig()
    for part in path.split("."):
        value = getattr(value, part)
    return value


def format_bytes(nbytes: int) -> str:
    """4096 -> '4KiB', 2147483648 -> '2GiB'; a size no binary unit divides stays in bytes."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def default_help(opt: Option) -> str:
    """'Default 2GiB.', 'Default: none.', 'Default 0 (no quota).', from ``DaemonConfig``."""
    value = config_default(opt.path)
    if opt.default_means and (value is False or value is None or value == ""):
        return f"Default: {opt.default_means}."
    if isinstance(value, bool):
        shown = "on" if value else "off"
    elif opt.parse is parse_bytes:
        shown = format_bytes(int(value))
    elif opt.parse is parse_octal:
        shown = f"{int(value):o}"
    elif value == "":
        shown = "empty"
    else:
        shown = str(value)
    return f"Default {shown} ({opt.default_means})." if opt.default_means else f"Default {shown}."


def option_help(opt: Option) -> str:
    return f"{opt.help} {default_help(opt)} (env: {opt.env})"


def add_daemon_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help="TOML file with the same options, each named as its flag with underscores, in the table of its "
        "section ([store], [tiers], [cluster]; see docs/kvpool.example.toml); env: KVPOOL_CONFIG",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective config as TOML, each key with where its value came from, and exit",
    )
    for opt in OPTIONS:
        if opt.parse is parse_switch:  # a bare flag; its env var and TOML key take true/false
            parser.add_argument(
                opt.flag,
                dest=opt.dest,
                default=None,
                action="store_const",
                const=True,
                help=option_help(opt),
            )
            continue
        parser.add_argument(opt.flag, dest=opt.dest, default=None, metavar=_metavar(opt), help=option_help(opt))


def _metavar(opt: Option) -> str:
    if opt.parse is parse_bytes:
        return "SIZE"
    if opt.parse is int:
        return "N"
    if opt.parse is float:
        return "FRACTION"
    return opt.flag.lstrip("-").split("-")[-1].upper()


def _set(values: dict[str, Any], path: str, value: Any) -> None:
    head, _, rest = path.partition(".")
    if rest:
        _set(values.setdefault(head, {}), rest, value)
    else:
        values[head] = value


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def load_config(args: argparse.Namespace, environ: Mapping[str, str]) -> DaemonConfig:
    """Merge defaults, the TOML file, the environment and the flags into a DaemonConfig."""
    return load_config_sources(args, environ)[0]


def _toml_option(key: str, config_file: str) -> Option:
    """The option a TOML key names: its key, or (accepted, not documented) its field path."""
    for opt in OPTIONS:
        if key in (opt.key, opt.path):
            return opt
    leaf = key.rpartition(".")[2]
    elsewhere = [opt.key for opt in OPTIONS if opt.key.rpartition(".")[2] == leaf]
    if elsewhere:
        section = elsewhere[0].rpartition(".")[0]
        where = f"under [{section}]" if section else "at the top level (before any [table])"
        hint = f"write it {where}; 'kvpool serve --print-config' shows every key in its place"
    else:
        close = difflib.get_close_matches(key, [opt.key for opt in OPTIONS], n=3)
        hint = (f"did you mean {', '.join(close)}? " if close else "") + "'kvpool serve --print-config' lists every key"
    raise InvalidArgument(f"unknown key {key!r} in {config_file}", hint=hint)


def load_config_sources(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[DaemonConfig, dict[str, str]]:
    """The merged DaemonConfig and, per option path set by something other than the default,
    where its value came from ("file PATH", "env NAME", "flag --NAME")."""
    by_path = {opt.path: opt for opt in OPTIONS}
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    config_file = getattr(args, "config", None) or environ.get("KVPOOL_CONFIG")
    if config_file:
        try:
            with open(config_file, "rb") as fh:
                table = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InvalidArgument(f"cannot read config file {config_file}: {exc}") from exc
        for key, value in _flatten(table).items():
            opt = _toml_option(key, config_file)
            merged[opt.path] = value
            sources[opt.path] = f"file {config_file}"
    for opt in OPTIONS:
        if opt.env in environ:
            merged[opt.path] = environ[opt.env]
            sources[opt.path] = f"env {opt.env}"
        flag_value = getattr(args, opt.dest, None)
        if flag_value is not None:
            merged[opt.path] = flag_value
            sources[opt.path] = f"flag {opt.flag}"
    nested: dict[str, Any] = {}
    for path, raw in merged.items():
        opt = by_path[path]
        try:
            value = opt.parse(raw)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"{opt.flag} / {opt.env}: cannot parse {raw!r}: {exc}") from exc
        _set(nested, path, value)
    base = DaemonConfig()
    store = dataclasses.replace(base.store, **nested.pop("store", {}))
    tiers = dataclasses.replace(base.tiers, **nested.pop("tiers", {}))
    cluster = dataclasses.replace(base.cluster, **nested.pop("cluster", {}))
    return dataclasses.replace(base, store=store, tiers=tiers, cluster=cluster, **nested), sources


def environ() -> Mapping[str, str]:
    """The process environment (read only here, at the composition root)."""
    return os.environ
