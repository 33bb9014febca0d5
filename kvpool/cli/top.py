"""Live view of a pool's stats: usage, hit rate and rates per second, refreshed every
--interval-s seconds until Ctrl-C.

  kvpool top [--address HOST:PORT] [--interval-s 1] [--iterations N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from kvpool.cli.inspect import DEFAULT_ADDRESS, add_connection_arguments, hit_rate_text, human_bytes, open_admin

#: counters shown as per-second rates (lookups and reads in blocks: docs/architecture.md "Counters")
RATE_KEYS = ("lookup_hit_blocks", "lookup_missed_blocks", "read_hit_blocks", "puts", "evictions", "checksum_failures")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", default=None, help=f"daemon HOST:PORT (env KVPOOL_ADDRESS; default {DEFAULT_ADDRESS})"
    )
    add_connection_arguments(parser)
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between refreshes")
    parser.add_argument("--iterations", type=int, default=0, help="stop after N refreshes (0 = until Ctrl-C)")


def run(args: argparse.Namespace) -> int:
    from kvpool.core.errors import KVPoolError

    address = args.address or os.environ.get("KVPOOL_ADDRESS") or DEFAULT_ADDRESS
    previous: dict[str, int] = {}
    n = 0
    try:
        with open_admin(args, address) as admin:
            while True:
                stats = admin.stats()
                capacity = stats.get("capacity_bytes", 0) or 1
                rates = {k: (stats.get(k, 0) - previous.get(k, stats.get(k, 0))) / args.interval_s for k in RATE_KEYS}
                print(
                    f"{time.strftime('%H:%M:%S')} {stats.get('node_id', '?')}  "
                    f"used {human_bytes(stats.get('used_bytes', 0))}/{human_bytes(capacity)} "
                    f"({100.0 * stats.get('used_bytes', 0) / capacity:.1f}%)  blocks {stats.get('blocks', 0)}  "
                    f"lookup hit rate {hit_rate_text(stats)}  " + "  ".join(f"{k}/s {v:.0f}" for k, v in rates.items()),
                    flush=True,
                )
                previous = {k: stats.get(k, 0) for k in RATE_KEYS}
                n += 1
                if args.iterations and n >= args.iterations:
                    return 0
                time.sleep(args.interval_s)
    except KVPoolError as err:
        print(f"kvpool top: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
