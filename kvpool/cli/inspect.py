"""Look inside a running pool.

  kvpool inspect stats [--json]        capacity, used, blocks, hits, misses, evictions, ...
  kvpool inspect namespaces [--json]   the KV specs (namespaces) the node serves, each with
                                       its lookup hit rate (docs/architecture.md "Counters")
  kvpool inspect events [--from-seq N] [--count N]   follow stored/removed events
  kvpool inspect blocks [--limit N]    block hashes the node holds (hex)

The address comes from --address, else KVPOOL_ADDRESS, else 127.0.0.1:7450. Against a
daemon with credentials pass an admin token with --token (else KVPOOL_TOKEN); against one
that serves TLS, the CA certificate with --tls-ca FILE (else KVPOOL_TLS_CA).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.client.admin import PoolAdmin

DEFAULT_ADDRESS = "127.0.0.1:7450"

STAT_ROWS = [
    ("capacity_bytes", "capacity"),
    ("used_bytes", "used"),
    ("blocks", "blocks"),
    ("lookup_calls", "lookups (calls)"),
    ("lookup_hit_blocks", "lookup hits (blocks)"),
    ("lookup_missed_blocks", "lookup misses (blocks)"),
    ("lookup_hit_tokens", "lookup hits (tokens)"),
    ("lookup_missed_tokens", "lookup misses (tokens)"),
    ("read_calls", "reads (calls)"),
    ("read_hit_blocks", "reads served (blocks)"),
    ("read_missed_blocks", "reads not served (blocks)"),
    ("puts", "blocks stored"),
    ("skipped_present", "puts skipped (present)"),
    ("evictions", "evictions"),
    ("removed", "removed"),
    ("checksum_failures", "checksum failures"),
    ("leases_active", "read leases held"),
    ("expired_leases", "leases expired"),
    ("pending_puts", "puts in flight"),
    ("reclaimed_puts", "puts reclaimed (writer died)"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["stats", "namespaces", "events", "blocks"], help="what to show")
    parser.add_argument(
        "--address", default=None, help=f"daemon HOST:PORT (env KVPOOL_ADDRESS; default {DEFAULT_ADDRESS})"
    )
    add_connection_arguments(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable JSON output")
    parser.add_argument("--from-seq", type=int, default=0, help="events: first sequence number (0 = oldest kept)")
    parser.add_argument("--count", type=int, default=0, help="events: stop after this many (0 = follow forever)")
    parser.add_argument("--limit", type=int, default=100, help="blocks: most hashes to print")


#: largest CA certificate file read, in bytes
MAX_CA_FILE_BYTES = 1 << 20


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """--token and --tls-ca, shared by the CLI commands that call a daemon."""
    parser.add_argument("--token", default=None, help="bearer token for a daemon with credentials (env KVPOOL_TOKEN)")
    parser.add_argument(
        "--tls-ca", default=None, metavar="FILE", help="PEM CA certificate of a TLS daemon (env KVPOOL_TLS_CA)"
    )


def open_admin(args: argparse.Namespace, address: str) -> PoolAdmin:
    """A PoolAdmin with the token and CA from the flags, else the environment (read only
    here, in the CLI's composition root)."""
    from kvpool.client.admin import PoolAdmin
    from kvpool.rpc.credentials import read_bounded

    token = args.token if args.token is not None else os.environ.get("KVPOOL_TOKEN", "")
    ca_path = args.tls_ca if args.tls_ca is not None else os.environ.get("KVPOOL_TLS_CA", "")
    root_certs = read_bounded(ca_path, MAX_CA_FILE_BYTES, "CA certificate") if ca_path else None
    return PoolAdmin(address, token=token, tls_root_certs=root_certs)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def hit_rate_text(stats: dict[str, Any]) -> str:
    """Lookup hit blocks / looked-up blocks (docs/architecture.md "Counters"); "n/a" before
    the first lookup, never a 100% made of nothing."""
    rate = stats.get("lookup_hit_rate")
    if rate is None:
        return "n/a (nothing looked up yet)"
    hit = stats.get("lookup_hit_blocks", 0)
    looked = hit + stats.get("lookup_missed_blocks", 0)
    return f"{100.0 * rate:.1f}% ({hit} of {looked} blocks)"


def render_stats(stats: dict[str, Any]) -> str:
    lines = [f"node {stats.get('node_id', '?')}  scheme {stats.get('hash_scheme', '?')}"]
    capacity = stats.get("capacity_bytes", 0) or 1
    for key, label in STAT_ROWS:
        if key not in stats:
            continue
        value = stats[key]
        if key.endswith("_bytes"):
            text = human_bytes(value)
            if key == "used_bytes":
                text += f" ({100.0 * value / capacity:.1f}%)"
        else:
            text = str(value)
        lines.append(f"  {label:<34} {text}")
    lines.append(f"  {'hit rate (lookups)':<34} {hit_rate_text(stats)}")
    by_tier = stats.get("lookup_hit_blocks_by_tier") or {}
    if by_tier:
        parts = ", ".join(f"{tier}={n}" for tier, n in by_tier.items())
        lines.append(f"  {'lookup hits by tier (blocks)':<34} {parts}")
    for tier, tier_stats in sorted((stats.get("tiers") or {}).items()):
        parts = ", ".join(f"{k}={v}" for k, v in sorted(tier_stats.items()))
        lines.append(f"  tier {tier}: {parts}")
    return "\n".join(lines)


def _all_namespaces(admin: PoolAdmin) -> list[dict[str, Any]]:
    """Every page of the Stats namespace list (an admin view, docs/security.md)."""
    out: list[dict[str, Any]] = []
    after = b""
    while True:
        stats = admin.stats(namespaces_after=after)
        out.extend(stats.get("namespaces", []))
        following = stats.get("namespaces_next", "")
        if not following:
            return out
        after = bytes.fromhex(following)


def run(args: argparse.Namespace) -> int:
    from kvpool.core.errors import KVPoolError

    address = args.address or os.environ.get("KVPOOL_ADDRESS") or DEFAULT_ADDRESS
    try:
        with open_admin(args, address) as admin:
            if args.what == "stats":
                stats = admin.stats()
                print(json.dumps(stats, indent=2, sort_keys=True) if args.json else render_stats(stats))
            elif args.what == "namespaces":
                namespaces = _all_namespaces(admin)
                if args.json:
                    print(json.dumps(namespaces, indent=2))
                else:
                    for ns in namespaces:
                        print(
                            f"{ns['digest']}  {ns['spec']}  ({human_bytes(ns['block_bytes'])} per block)  "
                            f"lookup hit rate {hit_rate_text(ns)}"
                        )
            elif args.what == "blocks":
                last_seq, hashes = admin.snapshot()
                shown = [h.hex() for h in hashes[: args.limit]]
                if args.json:
                    print(json.dumps({"last_seq": last_seq, "total": len(hashes), "hashes": shown}))
                else:
                    print(f"{len(hashes)} blocks (as of event {last_seq}); first {len(shown)}:")
                    print("\n".join(shown))
            else:
                for n, event in enumerate(admin.events(args.from_seq), start=1):
                    record = {
                        "node": event.node_id,
                        "seq": event.seq,
                        "kind": event.kind.value,
                        "blocks": len(event.hashes),
                        "namespace": event.namespace.hex(),
                    }
                    line = (
                        f"#{event.seq} {event.kind.value:<8} {len(event.hashes)} blocks ns={event.namespace.hex()[:8]}"
                    )
                    print(json.dumps(record) if args.json else line, flush=True)
                    if args.count and n >= args.count:
                        break
    except KVPoolError as err:
        print(f"kvpool inspect: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
