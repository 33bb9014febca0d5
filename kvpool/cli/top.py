"""Live view of a pool: nodes, tiers, hit rates, throughput, leases and evictions, redrawn in
place every --interval-s seconds. Press q (or Ctrl-C) to quit.

  kvpool top [--address HOST:PORT] [--directory HOST:PORT] [--interval-s 1] [--iterations N]

On a terminal it takes the whole screen (rich Live, the alternate screen) and restores the
terminal on exit; with its output piped it prints one plain frame per refresh instead (for
scripts and logs). With --directory it shows every member of the cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator
from typing import Any

from kvpool.cli.inspect import DEFAULT_ADDRESS, add_connection_arguments, address_of, open_admin
from kvpool.cli.inspect_render import hit_rate_text, human_bytes, make_console, tiers_of

#: counters shown as per-second rates: (stats key, column)
RATES = (
    ("lookup_hit_blocks", "lookup hits/s"),
    ("lookup_missed_blocks", "lookup misses/s"),
    ("read_hit_blocks", "reads/s"),
    ("puts", "puts/s"),
    ("evictions", "evictions/s"),
    ("checksum_failures", "checksum fails/s"),
)

#: bytes of stdin read per wake-up when looking for 'q'
KEY_READ_BYTES = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", default=None, help=f"daemon HOST:PORT (env KVPOOL_ADDRESS; default {DEFAULT_ADDRESS})"
    )
    parser.add_argument("--directory", default=None, help="a directory HOST:PORT: show every node of the cluster")
    add_connection_arguments(parser)
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between refreshes (default 1)")
    parser.add_argument("--iterations", type=int, default=0, help="stop after N refreshes (0 = until q or Ctrl-C)")


class Sampler:
    """Each node's stats now and the rates since the previous sample (from the counters'
    differences over the elapsed time, so a slow refresh does not inflate them)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self._previous: dict[str, tuple[float, dict[str, Any]]] = {}

    def addresses(self) -> list[str]:
        if not self._args.directory:
            return [address_of(self._args)]
        from kvpool.cli.inspect_ops import cluster_nodes

        return [str(n["control_address"]) for n in cluster_nodes(self._args)]

    def sample(self) -> list[dict[str, Any]]:
        from kvpool.core.errors import KVPoolError

        rows = []
        for address in self.addresses():
            now = time.monotonic()
            try:
                with open_admin(self._args, address) as admin:
                    stats = admin.stats()
            except KVPoolError as err:
                if not self._args.directory:
                    raise
                rows.append({"address": address, "error": err.message})
                continue
            before_t, before = self._previous.get(address, (now, stats))
            elapsed = max(now - before_t, 1e-9)
            stats["rates"] = {
                k: (stats.get(k, 0) - before.get(k, 0)) / elapsed if now > before_t else 0.0 for k, _ in RATES
            }
            self._previous[address] = (now, stats)
            rows.append({"address": address, **stats})
        return rows


def frame(rows: list[dict[str, Any]], interval_s: float) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text(f"kvpool top  {time.strftime('%H:%M:%S')}  every {interval_s:g} s  (q to quit)", style="bold")
    nodes = Table(title="nodes", title_justify="left", expand=True)
    for column in (
        "node",
        "used",
        "blocks",
        "lookup hit rate",
        "leases",
        "puts in flight",
        "evictions",
        "checksum fails",
    ):
        nodes.add_column(column)
    rates = Table(title="throughput (blocks/s)", title_justify="left", expand=True)
    rates.add_column("node")
    for _, column in RATES:
        rates.add_column(column, justify="right")
    tiers = Table(title="tiers", title_justify="left", expand=True)
    for column in ("node", "tier", "used", "blocks", "read hits", "evictions", "queued"):
        tiers.add_column(column)
    for row in rows:
        name = str(row.get("node_id", row["address"]))
        if "error" in row:
            nodes.add_row(name, f"unreachable: {row['error']}", "", "", "", "", "", "")
            continue
        capacity = row.get("capacity_bytes", 0) or 1
        used = row.get("used_bytes", 0)
        nodes.add_row(
            name,
            f"{human_bytes(used)} / {human_bytes(capacity)} ({100.0 * used / capacity:.1f}%)",
            str(row.get("blocks", 0)),
            hit_rate_text(row),
            str(row.get("leases_active", 0)),
            str(row.get("pending_puts", 0)),
            str(row.get("evictions", 0)),
            str(row.get("checksum_failures", 0)),
        )
        rates.add_row(name, *(f"{row['rates'][k]:.0f}" for k, _ in RATES))
        for tier, t in tiers_of(row).items():
            if t.get("enabled", True):
                tiers.add_row(
                    name,
                    tier,
                    f"{human_bytes(t.get('used_bytes', 0))} / {human_bytes(t.get('capacity_bytes', 0))}",
                    str(t.get("blocks", 0)),
                    str(t.get("hits", 0)),
                    str(t.get("evictions", 0)),
                    str(t.get("queued_blocks", "")),
                )
    return Group(head, nodes, rates, tiers)


def plain_frame(rows: list[dict[str, Any]]) -> str:
    """One refresh as lines, for a pipe: the node line keeps ``lookup hit rate ...``."""
    lines = []
    for row in rows:
        name = row.get("node_id", row["address"])
        if "error" in row:
            lines.append(f"{time.strftime('%H:%M:%S')} {name}  unreachable: {row['error']}")
            continue
        capacity = row.get("capacity_bytes", 0) or 1
        used = row.get("used_bytes", 0)
        rates = "  ".join(f"{column} {row['rates'][k]:.0f}" for k, column in RATES)
        lines.append(
            f"{time.strftime('%H:%M:%S')} {name}  used {human_bytes(used)}/{human_bytes(capacity)} "
            f"({100.0 * used / capacity:.1f}%)  blocks {row.get('blocks', 0)}  "
            f"lookup hit rate {hit_rate_text(row)}  leases {row.get('leases_active', 0)}  {rates}"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def keys_without_enter() -> Iterator[int | None]:
    """stdin in cbreak mode (keys arrive one by one, Ctrl-C still interrupts) while inside;
    yields its fd, or None when stdin is not a terminal. Restores the terminal on exit."""
    if not sys.stdin.isatty():
        yield None
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def wait_for_quit(fd: int | None, timeout_s: float) -> bool:
    """Sleep up to ``timeout_s``; True as soon as 'q' is pressed."""
    if fd is None:
        time.sleep(timeout_s)
        return False
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if ready and b"q" in os.read(fd, KEY_READ_BYTES).lower():
            return True
    return False


def run(args: argparse.Namespace) -> int:
    from kvpool.core.errors import KVPoolError

    if args.interval_s <= 0 or args.iterations < 0:
        print("kvpool top: --interval-s must be > 0 and --iterations >= 0", file=sys.stderr)
        return 2
    sampler = Sampler(args)
    try:
        rows = sampler.sample()  # an unreachable daemon fails here, before the screen is taken
        if not sys.stdout.isatty():
            return _plain(sampler, rows, args)
        return _live(sampler, rows, args)
    except KVPoolError as err:
        print(f"kvpool top: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _plain(sampler: Sampler, rows: list[dict[str, Any]], args: argparse.Namespace) -> int:
    n = 0
    while True:
        print(plain_frame(rows), flush=True)
        n += 1
        if args.iterations and n >= args.iterations:
            return 0
        time.sleep(args.interval_s)
        rows = sampler.sample()


def _live(sampler: Sampler, rows: list[dict[str, Any]], args: argparse.Namespace) -> int:
    from rich.live import Live

    console = make_console()
    n = 0
    with keys_without_enter() as fd, Live(console=console, screen=True, auto_refresh=False) as live:
        while True:
            live.update(frame(rows, args.interval_s), refresh=True)
            n += 1
            if args.iterations and n >= args.iterations:
                return 0
            if wait_for_quit(fd, args.interval_s):
                return 0
            rows = sampler.sample()
