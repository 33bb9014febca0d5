"""Configuration types (frozen). Reading flags, files and env happens only in the
daemon/CLI composition roots (``kvpool.daemon.config_loader``)."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

from kvpool.core.errors import InvalidArgument
from kvpool.core.fairness import TenantLimits

GiB = 1 << 30
MiB = 1 << 20
#: a per-tenant arena's segments are multiples of this (a huge page: where a segment starts)
SEGMENT_ALIGN_BYTES = 2 * MiB


@dataclass(frozen=True)
class StoreConfig:
    """Limits of one node's host tier."""

    capacity_bytes: int = 2 * GiB
    slab_bytes: int = 16 * MiB
    high_watermark: float = 0.95  # evict when a put would push usage above this fraction
    low_watermark: float = 0.85  # ...down to this fraction
    lease_ttl_ms: int = 10_000  # a read lease not released by then is dropped
    put_ttl_ms: int = 30_000  # a put not committed by then is reclaimed (writer died)
    max_batch_blocks: int = 65_536  # most blocks one call may name
    max_leases: int = 100_000  # most read leases held at once
    max_pending_puts: int = 10_000  # most puts between start and commit at once
    max_pin_ttl_ms: int = 86_400_000  # longest soft pin (one day); renew to keep longer
    # a same-host client's put is re-checksummed at commit in one block of N (at least one
    # per put, all of it once one fails); readers verify every block: HostStore.put_commit
    client_put_verify_one_in: int = 16
    # most bytes one namespace may hold in this tier (0 = no quota): a put past it evicts
    # that namespace's own least recently used blocks first, never another namespace's
    namespace_quota_bytes: int = 0
    # start even when capacity_bytes exceeds MemAvailable or the arena filesystem's free space
    # (a warning; the arena is then not reserved and clients may die with SIGBUS): storage/arena.py
    allow_overcommit: bool = False

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0 or self.slab_bytes <= 0:
            raise InvalidArgument("capacity_bytes and slab_bytes must be positive")
        if self.capacity_bytes < self.slab_bytes:
            raise InvalidArgument(
                f"capacity_bytes {self.capacity_bytes} is smaller than one slab ({self.slab_bytes})",
                hint="raise --capacity-bytes or lower --slab-bytes",
            )
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise InvalidArgument(
                f"watermarks must satisfy 0 < low ({self.low_watermark}) <= high ({self.high_watermark}) <= 1"
            )
        if self.namespace_quota_bytes < 0:
            raise InvalidArgument("namespace_quota_bytes must be >= 0 (0 = no quota)")
        for name in (
            "lease_ttl_ms",
            "put_ttl_ms",
            "max_batch_blocks",
            "max_leases",
            "max_pending_puts",
            "max_pin_ttl_ms",
            "client_put_verify_one_in",
        ):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be positive")


@dataclass(frozen=True)
class TierConfig:
    """The tiers beyond host DRAM. An empty ``disk_dir`` means no disk tier; a zero
    ``device_capacity_bytes`` means no device (HBM) tier."""

    host_policy: str = "lru"  # eviction policy of the host tier
    disk_dir: str = ""
    disk_capacity_bytes: int = 16 * GiB
    disk_slab_file_bytes: int = 1 * GiB  # each preallocated slab file
    disk_policy: str = "lru"
    disk_high_watermark: float = 0.95  # a write that would take the disk above this fraction...
    disk_low_watermark: float = 0.85  # ...first evicts it down to this fraction (by disk_policy)
    disk_admission: str = "all"  # "all" | "second-hit": skip one-hit blocks on disk
    disk_io_threads: int = 4
    write_behind_queue_blocks: int = 1024  # bounded host -> disk queue
    shutdown_flush_ms: int = 10_000  # on SIGTERM, write host-only blocks to disk for at most this long
    device_capacity_bytes: int = 0
    device: str = "cuda"  # "cuda", or "cpu" only behind the test switch
    device_policy: str = "lru"
    device_high_watermark: float = 0.95  # as the disk's, for the device (HBM) arena
    device_low_watermark: float = 0.85

    def __post_init__(self) -> None:
        for tier in ("disk", "device"):
            low, high = getattr(self, f"{tier}_low_watermark"), getattr(self, f"{tier}_high_watermark")
            if not 0.0 < low <= high <= 1.0:
                raise InvalidArgument(
                    f"{tier} watermarks must satisfy 0 < low ({low}) <= high ({high}) <= 1",
                    hint=f"e.g. --{tier}-high-watermark 0.95 --{tier}-low-watermark 0.85",
                )
        if self.disk_admission not in ("all", "second-hit"):
            raise InvalidArgument(f"disk_admission {self.disk_admission!r} is not 'all' or 'second-hit'")
        for name in ("disk_capacity_bytes", "disk_slab_file_bytes", "disk_io_threads", "write_behind_queue_blocks"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be positive")
        if self.device_capacity_bytes < 0:
            raise InvalidArgument("device_capacity_bytes must be >= 0")
        if self.shutdown_flush_ms < 0:
            raise InvalidArgument("shutdown_flush_ms must be >= 0 (0: do not write host blocks to disk at exit)")


@dataclass(frozen=True)
class ClusterConfig:
    """Cluster mode of a node (all off by default: the embedded single-machine pool).

    ``directory`` / ``etcd`` are comma-separated address lists. Setting either (or
    ``data_listen``) starts the data-plane server; setting either of the first two also
    registers the node with the directory leader and streams its KV events there.
    """

    directory: str = ""  # directory addresses, e.g. "127.0.0.1:7440,127.0.0.1:7441"
    etcd: str = ""  # etcd client endpoints, e.g. "127.0.0.1:2379"
    cluster: str = "default"  # etcd key prefix
    data_listen: str = ""  # data-plane address; "" = 127.0.0.1 on a free port when clustered
    # data plane: "tcp" (sockets), "ucx" (ucxx; falls back to tcp if missing) or "nixl" (NIXL
    # one-sided reads; refuses to start without nixl-cu12): docs/cluster.md "Choosing a transport"
    transport: str = "tcp"
    host: str = ""  # host name peers compare to decide same-host (shared memory); "" = gethostname()
    heartbeat_interval_ms: int = 500
    liveness_ttl_s: int = 3  # etcd lease TTL of this node's liveness key
    kv_events_endpoint: str = ""  # ZMQ PUB endpoint for vLLM-format KV events, e.g. tcp://127.0.0.1:5557
    kv_events_topic: str = ""
    kv_events_replay_endpoint: str = ""  # ZMQ ROUTER endpoint answering vLLM-style replay requests
    token_file: str = ""  # file holding the cluster token the node presents to the directory; "" = none
    directory_tls_ca: str = ""  # PEM CA of a TLS directory (docs/security.md); "" = dial it in plaintext
    # TLS on the TCP data plane with the control plane's --tls-cert-file / --tls-key-file
    # (docs/security.md "Data-plane TLS": costs throughput; UCX / NIXL bytes stay in the clear)
    data_tls: bool = False

    def __post_init__(self) -> None:
        if self.transport not in ("tcp", "ucx", "nixl"):
            raise InvalidArgument(f"transport {self.transport!r} is not 'tcp', 'ucx' or 'nixl'")
        if self.heartbeat_interval_ms <= 0 or self.liveness_ttl_s <= 0:
            raise InvalidArgument("heartbeat_interval_ms and liveness_ttl_s must be positive")

    @property
    def enabled(self) -> bool:
        return bool(self.directory or self.etcd or self.data_listen)

    @property
    def directory_list(self) -> tuple[str, ...]:
        return tuple(a.strip() for a in self.directory.split(",") if a.strip())

    @property
    def etcd_list(self) -> tuple[str, ...]:
        return tuple(a.strip() for a in self.etcd.split(",") if a.strip())


@dataclass(frozen=True)
class DaemonConfig:
    """Everything ``kvpool serve`` needs. See ``kvpool serve --help`` for each field."""

    listen: str = "127.0.0.1:7450"
    arena_dir: str = "/dev/shm"
    store: StoreConfig = StoreConfig()
    tiers: TierConfig = TierConfig()
    node_id: str = ""  # defaults to host:port
    grpc_workers: int = 8
    max_message_bytes: int = 64 * MiB
    sweep_interval_ms: int = 500
    log_level: str = "INFO"
    cluster: ClusterConfig = ClusterConfig()
    # all-namespace views (Snapshot/Events with all_namespaces, the Stats namespace list):
    # "loopback" = served only when ``listen`` is a loopback address; "on"; "off"
    admin_views: str = "loopback"
    max_namespaces: int = 4096  # namespaces registered at once; blockless idle ones are retired first
    namespace_idle_ms: int = 600_000  # a namespace with no blocks and no call for this long is retired
    # authentication (docs/security.md): a credentials file (token hashes -> tenants, admins);
    # "" = none, allowed only on a loopback --listen unless ``insecure``
    credentials_file: str = ""
    tls_cert_file: str = ""  # PEM certificate chain of the control-plane listener; "" = plaintext
    tls_key_file: str = ""  # its PEM private key
    insecure: bool = False  # allow a non-loopback listener without credentials or TLS
    # how same-host clients get the arena: "file" (a 0600 file in arena_dir, opened by path),
    # "fd" (an anonymous memfd handed over a Unix socket after the token), "auto" (fd with credentials)
    arena_handoff: str = "auto"
    # the arena's pages: "off" (4 KiB shared memory), "on" (reserved huge pages, MFD_HUGETLB;
    # refuse to start without them), "thp" (transparent huge pages of shared memory, nothing
    # reserved; refuse to start where the host's shmem_enabled gives none: storage/thp.py),
    # "try" (reserved ones where the host has enough, else transparent ones where it gives
    # them, else 4 KiB with a warning). Huge pages need the memfd hand-off ("auto" becomes fd)
    arena_huge_pages: str = "off"
    # per-tenant arenas (docs/security.md): with credentials and the memfd hand-off the arena
    # is made of segments of this many bytes, each owned by one tenant group at a time and
    # handed only to its clients; 0 = auto (capacity / 16, at most 64 MiB, a multiple of
    # the slab size and of 2 MiB)
    arena_segment_bytes: int = 0
    # Prometheus GET /metrics, HOST:PORT; "" = off (docs/metrics.md). Not loopback needs ``insecure``.
    metrics_listen: str = ""
    # file mode of the hand-off socket, octal: 0o600 admits only the daemon's uid; 0o666 lets
    # clients of other uids connect (they still need a token to get the arena)
    arena_socket_mode: int = 0o600
    # also answer same-host unary calls over a Unix socket in arena_dir (same handlers, token
    # and tenant gate as gRPC; ~0.4 ms a paced lookup instead of gRPC's ~1.3 ms here): kvpool.rpc.local_call
    local_calls: bool = True
    # keep the block index out of full garbage collections (kvpool.daemon.gc_pauses): after
    # each one its survivors are frozen, and every gc_full_interval_s (0 = never) one whole
    # pass reclaims cycles among them. Only ``kvpool serve`` applies it (GC is process-wide)
    gc_freeze: bool = True
    gc_full_interval_s: int = 3600
    # make the daemon non-dumpable (prctl PR_SET_DUMPABLE 0): processes of its uid can then not
    # open /proc/PID/fd, /proc/PID/mem or ptrace it (no core dumps either); "auto" = on with credentials
    protect_process: str = "auto"
    # per-tenant fairness (kvpool/core/fairness.py): cost units one tenant may have in flight
    # (0 = off), worker threads one tenant may hold (0 = half of grpc_workers), and how long a
    # call over its tenant's budget waits for room before it is refused TENANT_BUSY
    tenant_budget_units: int = TenantLimits.budget_units
    tenant_rate_units_per_s: int = TenantLimits.rate_units_per_s  # cost units per s (0 = no rate)
    tenant_max_calls: int = TenantLimits.max_calls
    # request items (hashes) each block a Lookup / Lease finds costs, billed after the call
    # (fairness.TenantGate.charge); 0 = calls cost by their request size only
    tenant_walk_cost_items: int = TenantLimits.walk_cost_items
    # request items every call costs besides its own (fairness.TenantGate call_rate_units): a
    # flood of small calls is rate-limited too; 0 = calls under 1,024 items are never rate-limited
    tenant_call_cost_items: int = TenantLimits.call_cost_items
    tenant_wait_ms: int = TenantLimits.wait_ms
    # per-tenant shares of the TCP data plane (kvpool/transport/shares.py): bytes of READ /
    # WRITE transfers one tenant may have in flight (0 = ungated) and transfers at once
    tenant_data_inflight_bytes: int = 256 * MiB
    tenant_data_transfers: int = 64  # a quarter of the data plane's 256 connections

    def __post_init__(self) -> None:
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"listen address {self.listen!r} is not HOST:PORT", hint="e.g. 127.0.0.1:7450")
        if self.grpc_workers <= 0 or self.sweep_interval_ms <= 0:
            raise InvalidArgument("grpc_workers and sweep_interval_ms must be positive")
        if self.admin_views not in ("loopback", "on", "off"):
            raise InvalidArgument(f"admin_views {self.admin_views!r} is not 'loopback', 'on' or 'off'")
        if self.max_namespaces <= 0 or self.namespace_idle_ms <= 0:
            raise InvalidArgument("max_namespaces and namespace_idle_ms must be positive")
        _ = self.tenant_limits  # validates the --tenant-* limits (InvalidArgument)
        if self.tenant_data_inflight_bytes < 0 or self.tenant_data_transfers < 0:
            raise InvalidArgument("the --tenant-data-* limits must be >= 0")
        if self.gc_full_interval_s < 0:
            raise InvalidArgument("gc_full_interval_s must be >= 0 (0: never)")
        if not 0 <= self.arena_socket_mode <= 0o777 or self.arena_socket_mode & 0o111:
            raise InvalidArgument(f"arena_socket_mode {self.arena_socket_mode:o} is not a file mode like 600 or 660")
        if self.protect_process not in ("auto", "on", "off"):
            raise InvalidArgument(f"protect_process {self.protect_process!r} is not 'auto', 'on' or 'off'")
        if self.arena_handoff not in ("auto", "file", "fd"):
            raise InvalidArgument(f"arena_handoff {self.arena_handoff!r} is not 'auto', 'file' or 'fd'")
        if self.arena_huge_pages not in ("off", "on", "thp", "try"):
            raise InvalidArgument(f"arena_huge_pages {self.arena_huge_pages!r} is not 'off', 'on', 'thp' or 'try'")
        if self.arena_huge_pages in ("on", "thp") and self.arena_handoff == "file":
            raise InvalidArgument(
                f"--arena-huge-pages {self.arena_huge_pages} needs the memfd hand-off: a huge-page arena has no "
                "file in --arena-dir",
                hint="use --arena-handoff fd (or auto), or --arena-huge-pages try to fall back to 4 KiB pages",
            )
        if self.arena_segment_bytes < 0 or self.arena_segment_bytes % self.segment_unit_bytes:
            raise InvalidArgument(
                f"arena_segment_bytes {self.arena_segment_bytes} is not a multiple of {self.segment_unit_bytes} "
                "(the slab size and 2 MiB)",
                hint="use a multiple of both --slab-bytes and 2 MiB, or 0 (auto)",
            )
        if self.metrics_listen:
            host, _, port = self.metrics_listen.rpartition(":")
            if not host or not port.isdigit():
                raise InvalidArgument(
                    f"metrics address {self.metrics_listen!r} is not HOST:PORT", hint="e.g. 127.0.0.1:9450"
                )
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise InvalidArgument("TLS needs both --tls-cert-file and --tls-key-file", hint="give both, or neither")
        if self.cluster.data_tls and not self.tls_cert_file:
            raise InvalidArgument(
                "--data-tls uses the control plane's certificate", hint="give --tls-cert-file and --tls-key-file"
            )
        self._refuse_open_listeners()

    def _refuse_open_listeners(self) -> None:
        """A listener off loopback needs credentials and TLS (a bearer token in plaintext
        can be read off the wire), unless the operator says ``insecure``. Checked here, at
        validation, so the daemon refuses before it binds anything."""
        if self.insecure:
            return
        listeners = (self.listen, self.cluster.data_listen, self.metrics_listen)
        open_ports = [a for a in listeners if a and not is_loopback_address(a)]
        if not open_ports:
            return
        missing = [
            what
            for what, ok in (("--credentials", self.credentials_file), ("--tls-cert-file", self.tls_cert_file))
            if not ok
        ]
        if missing:
            raise InvalidArgument(
                f"refusing to listen on {', '.join(open_ports)} (not loopback) without {' and '.join(missing)}",
                hint="configure credentials and TLS (docs/security.md), keep the daemon on 127.0.0.1, "
                "or pass --insecure on a network you trust",
            )

    @property
    def tenant_limits(self) -> TenantLimits:
        """The per-tenant fairness options as one value (``kvpool/core/fairness.py``)."""
        return TenantLimits(
            self.tenant_budget_units,
            self.tenant_rate_units_per_s,
            self.tenant_max_calls,
            self.tenant_wait_ms,
            self.tenant_walk_cost_items,
            self.tenant_call_cost_items,
        )

    @property
    def process_protected(self) -> bool:
        """Whether the daemon makes itself non-dumpable at start (docs/security.md)."""
        return self.protect_process == "on" or (self.protect_process == "auto" and bool(self.credentials_file))

    @property
    def arena_by_fd(self) -> bool:
        """Whether the arena is a memfd handed to admitted clients (docs/security.md): "auto"
        is fd with credentials, and with huge pages (a hugetlb memfd has no file to open)."""
        if self.arena_handoff == "auto":
            return bool(self.credentials_file) or self.arena_huge_pages != "off"
        return self.arena_handoff == "fd"

    @property
    def segment_unit_bytes(self) -> int:
        """What a segment's size must be a multiple of: a slab (slabs never straddle two
        segments) and 2 MiB (a huge page, where a segment must start)."""
        return math.lcm(self.store.slab_bytes, SEGMENT_ALIGN_BYTES)

    @property
    def arena_per_tenant(self) -> bool:
        """Whether the arena is made of per-tenant segments: with credentials (tenants to tell
        apart) and the memfd hand-off (a file would give everyone everything); not with the
        NIXL transport, which registers the arena's pages once (a segment that changes owner
        gets fresh pages) and serves one tenant only anyway (docs/cluster.md)."""
        return self.arena_by_fd and bool(self.credentials_file) and self.cluster.transport != "nixl"

    @property
    def segment_bytes(self) -> int:
        """The arena's segment size, 0 for a one-piece arena (``arena_segment_bytes``; auto:
        a sixteenth of the capacity, at most 64 MiB, at least one unit)."""
        if not self.arena_per_tenant:
            return 0
        if self.arena_segment_bytes:
            return self.arena_segment_bytes
        unit = self.segment_unit_bytes
        return max(unit, min(64 * MiB, self.store.capacity_bytes // 16) // unit * unit)

    @property
    def admin_enabled(self) -> bool:
        """Whether this listener serves admin views at all. Without credentials the loopback
        default serves them to every local caller that asks; with credentials only to an
        admin credential, and only where this is true (docs/security.md)."""
        if self.credentials_file:
            return self.admin_views != "off"
        if self.admin_views != "loopback":
            return self.admin_views == "on"
        return is_loopback_address(self.listen)


def is_loopback_address(address: str) -> bool:
    """Whether HOST:PORT names a loopback host: 127.0.0.0/8, ::1 or localhost."""
    host = address.rpartition(":")[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere
