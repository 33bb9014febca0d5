"""Look inside a running pool. Every view prints a table, or JSON with --json.

  kvpool inspect stats                 capacity, used, blocks, hits, misses, evictions, tiers
  kvpool inspect tiers                 each tier: capacity, use, hits, evictions, policy
  kvpool inspect namespaces            the namespaces (KV specs) served, with hit rates
  kvpool inspect nodes [--directory A] the members: liveness, load, tiers, hit rate
  kvpool inspect events [--count N] [--follow]   the last N events (hashes, tier); --follow
  kvpool inspect blocks [--limit N]    block hashes the node holds
  kvpool inspect hot [--limit N]       most-read blocks and prefixes
  kvpool inspect hitrate [--plot F.png] lookup hit rate over time, per tier
  kvpool inspect lookup --tokens FILE  per block: hit or miss, node, tier, and why the chain
                                       stops (put in flight, evicted when and by which
                                       policy, checksum failure or I/O error and on which
                                       tier, removed, other namespace, never stored); and
                                       why a reader's lease was refused
  kvpool inspect pin|unpin|evict --tokens FILE | --hashes HEX,...   (admin)
  kvpool inspect clear [--namespace HEX] [--yes]                   (admin; asks first)
  kvpool inspect doctor                config, connectivity, disk, memory, etcd, UCX

The address comes from --address, else KVPOOL_ADDRESS, else 127.0.0.1:7450. Against a
daemon with credentials pass an admin token with --token (else KVPOOL_TOKEN); against one
that serves TLS, the CA certificate with --tls-ca FILE (else KVPOOL_TLS_CA); with
--directory, a directory that serves TLS needs --directory-tls-ca FILE (else
KVPOOL_DIRECTORY_TLS_CA) and its nodes --tls-ca. Token files
hold a JSON list of integers or whitespace-separated integers ('-' reads stdin);
--text with --tokenizer NAME tokenizes with a tokenizer transformers can load locally.
A namespace is its digest (hex, or a unique prefix); with one namespace on the node it is
the default. Errors print one line and exit non-zero (1: the daemon said no, 2: bad input).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from kvpool.cli.inspect_render import hit_rate_text, human_bytes

if TYPE_CHECKING:
    from kvpool.client.admin import PoolAdmin

__all__ = ["DEFAULT_ADDRESS", "add_connection_arguments", "hit_rate_text", "human_bytes", "open_admin"]

DEFAULT_ADDRESS = "127.0.0.1:7450"

#: largest CA certificate file read, in bytes

#: subcommand -> (function name in kvpool.cli.inspect_ops, help)
VIEWS: dict[str, str] = {
    "stats": "capacity, use, hits, misses, evictions and the tiers",
    "tiers": "each tier: capacity, use, read hits and misses, evictions, policy",
    "namespaces": "the namespaces (KV specs) the node serves, with lookup hit rates",
    "nodes": "members: liveness, load, tiers, hit rate (the directory's list with --directory)",
    "events": "the last --count events and exit; --follow to follow",
    "blocks": "block hashes the node holds",
    "hot": "most-read blocks and prefixes",
    "hitrate": "the lookup hit rate over time, per tier (--plot FILE.png for a picture)",
    "lookup": "why a prompt hits or misses, block by block",
    "pin": "pin blocks against eviction (admin)",
    "unpin": "unpin blocks (admin)",
    "evict": "remove blocks from the node (admin)",
    "clear": "remove every block of a namespace, or of all (admin; asks unless --yes)",
    "doctor": "check config, connectivity, disk, memory, etcd, UCX; says what to fix",
}


class BadInput(Exception):
    """Input the user must fix (a file, a flag): one line, exit 2."""


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """--token and --tls-ca, shared by the CLI commands that call a daemon."""
    parser.add_argument("--token", default=None, help="bearer token for a daemon with credentials (env KVPOOL_TOKEN)")
    parser.add_argument(
        "--tls-ca", default=None, metavar="FILE", help="PEM CA certificate of a TLS daemon (env KVPOOL_TLS_CA)"
    )
    parser.add_argument(
        "--directory-tls-ca",
        default=None,
        metavar="FILE",
        help="PEM CA certificate of a TLS directory, for --directory (env KVPOOL_DIRECTORY_TLS_CA)",
    )


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--address", default=None, help=f"daemon HOST:PORT (env KVPOOL_ADDRESS; default {DEFAULT_ADDRESS})"
    )
    add_connection_arguments(common)
    common.add_argument("--json", action="store_true", help="machine-readable JSON output")
    return common


def _blocks_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", default=None, help="namespace digest (hex or unique prefix)")
    parser.add_argument(
        "--tokens", default=None, metavar="FILE", help="token ids: JSON list or whitespace-separated; - = stdin"
    )
    parser.add_argument("--text", default=None, help="prompt text (needs --tokenizer)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer transformers can load locally (name or path)")
    parser.add_argument("--hashes", default=None, help="block hashes instead: comma-separated hex")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common = _common()
    sub = parser.add_subparsers(dest="what", metavar="VIEW", required=True)
    views = {name: sub.add_parser(name, help=text, description=text, parents=[common]) for name, text in VIEWS.items()}
    views["events"].add_argument("--count", type=int, default=20, help="how many of the latest events (default 20)")
    views["events"].add_argument("--follow", action="store_true", help="then follow new events until Ctrl-C")
    views["events"].add_argument(
        "--from-seq", type=int, default=0, help="start at this seq instead of the last --count"
    )
    views["blocks"].add_argument("--limit", type=int, default=100, help="most hashes to print (default 100)")
    views["hot"].add_argument("--limit", type=int, default=20, help="entries of each list (default 20)")
    views["hitrate"].add_argument("--samples", type=int, default=10, help="intervals to sample (default 10)")
    views["hitrate"].add_argument("--interval-s", type=float, default=1.0, help="seconds per interval (default 1)")
    views["hitrate"].add_argument("--plot", default=None, metavar="FILE.png", help="also draw it (needs matplotlib)")
    for name in ("nodes", "lookup"):
        views[name].add_argument("--directory", default=None, help="a directory HOST:PORT: the whole cluster's view")
    for name in ("lookup", "pin", "unpin", "evict"):
        _blocks_arguments(views[name])
    views["pin"].add_argument("--ttl-ms", type=int, default=None, help="soft pin for this long (default: hard pin)")
    views["clear"].add_argument("--namespace", default=None, help="only this namespace (default: every namespace)")
    views["clear"].add_argument("--yes", action="store_true", help="do not ask")
    views["doctor"].add_argument("--config", default=None, metavar="FILE.toml", help="the daemon's config file")
    views["doctor"].add_argument("--etcd", default=None, help="etcd endpoints to check (default: from the config)")


def open_admin(args: argparse.Namespace, address: str) -> PoolAdmin:
    """A PoolAdmin with the token and CA from the flags, else the environment (read only
    here, in the CLI's composition root)."""
    from kvpool.client.admin import PoolAdmin

    return PoolAdmin(address, token=token_of(args), tls_root_certs=root_certs_of(args, "tls_ca"))


def token_of(args: argparse.Namespace) -> str:
    return str(args.token if args.token is not None else os.environ.get("KVPOOL_TOKEN", ""))


def root_certs_of(args: argparse.Namespace, flag: str) -> bytes | None:
    """The CA file of ``--tls-ca`` / ``--directory-tls-ca`` (``flag``), else its environment
    variable (KVPOOL_TLS_CA, KVPOOL_DIRECTORY_TLS_CA); None: plaintext."""
    from kvpool.rpc.credentials import load_root_certs

    path = getattr(args, flag, None)
    if path is None:
        path = os.environ.get("KVPOOL_" + flag.upper(), "")
    return load_root_certs(path)


def address_of(args: argparse.Namespace) -> str:
    return str(args.address or os.environ.get("KVPOOL_ADDRESS") or DEFAULT_ADDRESS)


def run(args: argparse.Namespace) -> int:
    from kvpool.cli import inspect_ops
    from kvpool.core.errors import KVPoolError

    try:
        handler: Any = getattr(inspect_ops, f"do_{args.what}")
        return int(handler(args) or 0)
    except BadInput as err:
        print(f"kvpool inspect {args.what}: {err}", file=sys.stderr)
        return 2
    except KVPoolError as err:
        print(f"kvpool inspect {args.what}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
