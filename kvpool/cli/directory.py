"""Run the cluster directory (master): which node holds which block, placement, leases,
node registration and heartbeats. With --etcd, several instances elect one leader and
the others stand by; nodes and clients find the leader through etcd. With --data-dir,
its state lives in RocksDB and a restarted directory answers at once.

Example:
  kvpool directory --listen 127.0.0.1:7440 --data-dir /var/lib/kvpool/dir --etcd 127.0.0.1:2379
  kvpool directory --listen 10.0.0.2:7440 --credentials creds.toml --cluster-token-file cluster.token \
                   --tls-cert-file dir.pem --tls-key-file dir.key --node-tls-ca ca.pem
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvpool.core import invariants
from kvpool.core.fairness import TenantLimits

#: the node's per-tenant fairness options, for the directory's calls (docs/security.md)
TENANT_FLAGS = (
    ("--tenant-budget-units", "per-tenant fairness: cost units one tenant may have in flight; 0 = off"),
    ("--tenant-rate-units-per-s", "cost units one tenant may spend per second; 0 = no rate"),
    ("--tenant-max-calls", "calls one tenant may have in the directory; 0 = half of its workers"),
    ("--tenant-wait-ms", "how long a call past its tenant's share waits before TENANT_BUSY"),
    ("--tenant-walk-cost-items", "hashes each block a Lookup finds costs, billed after it"),
    ("--tenant-call-cost-items", "hashes every call costs besides its own (small calls rate-limited too)"),
)


def _limit(flag: str) -> str:
    """``--tenant-wait-ms`` -> ``wait_ms``: the ``TenantLimits`` field a flag sets."""
    return flag.removeprefix("--tenant-").replace("-", "_")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:7440", help="gRPC address, HOST:PORT (default 127.0.0.1:7440)")
    parser.add_argument("--advertise", default="", help="address others reach this instance at (default: --listen)")
    parser.add_argument("--data-dir", default="", help="RocksDB directory for durable state (default: memory only)")
    parser.add_argument(
        "--etcd",
        default="",
        help="comma-separated etcd client endpoints, e.g. 127.0.0.1:2379; "
        "enables leader election and lease-based node liveness",
    )
    parser.add_argument("--cluster", default="default", help="cluster name (etcd key prefix). Default 'default'.")
    parser.add_argument(
        "--node-ttl-ms", type=int, default=5000, help="drop a node after this long without a heartbeat (default 5000)"
    )
    parser.add_argument("--election-ttl-s", type=int, default=2, help="leader lease TTL in etcd (default 2)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--credentials", default="", help="credentials file: who may call (docs/security.md). Default: anyone"
    )
    parser.add_argument(
        "--cluster-token-file", default="", help="file holding the cluster token, presented to nodes on forwards"
    )
    parser.add_argument(
        "--tls-cert-file", default="", help="PEM certificate chain: serve TLS on --listen (default: plaintext)"
    )
    parser.add_argument("--tls-key-file", default="", help="PEM private key of --tls-cert-file")
    parser.add_argument(
        "--node-tls-ca",
        default="",
        metavar="FILE",
        help="PEM CA of the nodes' TLS control planes (removes and pins are forwarded there); default: plaintext",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --listen without credentials and TLS (a trusted network only)",
    )
    defaults = TenantLimits()
    for flag, help_text in TENANT_FLAGS:
        parser.add_argument(
            flag, type=int, default=getattr(defaults, _limit(flag)), help=f"{help_text} (default %(default)s)"
        )
    parser.add_argument(
        "--metrics-listen",
        default="",
        metavar="HOST:PORT",
        help="serve Prometheus GET /metrics here, e.g. 127.0.0.1:9440 (default: off; docs/metrics.md)",
    )


def run(args: argparse.Namespace) -> int:
    from kvpool.core.errors import KVPoolError
    from kvpool.directory.server import DirectoryConfig, DirectoryServer

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    invariants.log_if_enabled(logging.getLogger("kvpool.directory"))
    try:
        config = DirectoryConfig(
            listen=args.listen,
            advertise=args.advertise,
            data_dir=args.data_dir,
            etcd=tuple(e for e in args.etcd.split(",") if e),
            cluster=args.cluster,
            node_ttl_ms=args.node_ttl_ms,
            election_ttl_s=args.election_ttl_s,
            credentials_file=args.credentials,
            cluster_token_file=args.cluster_token_file,
            tls_cert_file=args.tls_cert_file,
            tls_key_file=args.tls_key_file,
            node_tls_ca_file=args.node_tls_ca,
            insecure=args.insecure,
            metrics_listen=args.metrics_listen,
            tenant=TenantLimits(**{_limit(flag): getattr(args, "tenant_" + _limit(flag)) for flag, _ in TENANT_FLAGS}),
        )
        server = DirectoryServer(config)
        server.start()
    except KVPoolError as err:
        print(f"kvpool directory: {err}", file=sys.stderr)
        return 1
    print(f"kvpool directory: serving on {config.listen}", file=sys.stderr, flush=True)
    return server.wait()
