"""``kvpool inspect hitrate``: the lookup hit rate over time, per tier, sampled from the
node's counters (docs/architecture.md "Counters"), as a table, JSON or a PNG (--plot).

The first Stats call is the baseline; each of the --samples that follow, --interval-s apart,
gives one interval's rates: hits by tier / looked-up blocks in that interval (an interval
with no lookups has no rate: null, a gap in the plot, never 0% or 100%).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvpool.cli.inspect import BadInput, address_of, open_admin
from kvpool.daemon.counters import TIERS

#: most samples one run takes
MAX_SAMPLES = 10_000


def interval_rates(before: dict[str, Any], after: dict[str, Any], at_s: float) -> dict[str, Any]:
    """One interval's lookup hit rate per tier and in total (pure: tested on its own)."""
    hits_before = before.get("lookup_hit_blocks_by_tier") or {}
    hits_after = after.get("lookup_hit_blocks_by_tier") or {}
    hits = {t: int(hits_after.get(t, 0)) - int(hits_before.get(t, 0)) for t in TIERS}
    missed = int(after.get("lookup_missed_blocks", 0)) - int(before.get("lookup_missed_blocks", 0))
    looked = sum(hits.values()) + missed
    rates = {t: (hits[t] / looked if looked else None) for t in TIERS}
    return {
        "t_s": round(at_s, 3),
        "looked_up_blocks": looked,
        "hit_blocks": hits,
        "hit_rate": sum(hits.values()) / looked if looked else None,
        "hit_rate_by_tier": rates,
    }


def sample(args: argparse.Namespace) -> list[dict[str, Any]]:
    if not 1 <= args.samples <= MAX_SAMPLES or args.interval_s <= 0:
        raise BadInput(f"--samples must be 1..{MAX_SAMPLES} and --interval-s > 0")
    out = []
    with open_admin(args, address_of(args)) as admin:
        start = time.monotonic()
        previous = admin.stats()
        for _ in range(args.samples):
            time.sleep(args.interval_s)
            current = admin.stats()
            out.append(interval_rates(previous, current, time.monotonic() - start))
            previous = current
    return out


def plot(path: str, samples: list[dict[str, Any]], title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInput("--plot needs matplotlib: pip install 'kvpool[sim]'") from None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    t = [s["t_s"] for s in samples]
    for tier in TIERS:
        ys = [s["hit_rate_by_tier"][tier] for s in samples]
        if any(y for y in ys):
            ax.plot(t, [float("nan") if y is None else 100.0 * y for y in ys], marker="o", label=tier)
    total = [float("nan") if s["hit_rate"] is None else 100.0 * s["hit_rate"] for s in samples]
    ax.plot(t, total, color="black", linestyle="--", label="all tiers")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("lookup hit rate (% of looked-up blocks)")
    ax.set_ylim(0, 103)  # room for a line at 100%
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")  # exactly PATH (matplotlib would add .png to a name without one)
    except OSError as exc:
        raise BadInput(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def view(samples: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title="lookup hit rate per interval", title_justify="left")
    for column in ("t (s)", "looked up", "all", *TIERS):
        table.add_column(column, justify="right")

    def pct(rate: float | None) -> str:
        return "-" if rate is None else f"{100.0 * rate:.1f}%"

    for s in samples:
        table.add_row(
            f"{s['t_s']:.1f}",
            str(s["looked_up_blocks"]),
            pct(s["hit_rate"]),
            *(pct(s["hit_rate_by_tier"][t]) for t in TIERS),
        )
    return table


def do_hitrate(args: argparse.Namespace) -> int:
    from kvpool.cli.inspect_ops import emit
    from kvpool.cli.paths import unwritable_file

    problem = unwritable_file("--plot", args.plot) if args.plot else ""
    if problem:  # before the sampling, not after it
        raise BadInput(problem)
    samples = sample(args)
    if args.plot:
        plot(args.plot, samples, f"kvpool {address_of(args)}: lookup hit rate by tier")
    return emit(args, samples, view)
