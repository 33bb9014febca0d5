"""The simulator's capacity curve: mean TTFT (and hit rate) of each policy as the global
pool's capacity grows from none to unbounded, as a table and a picture.

One shape for both places that draw it: ``kvpool sim --capacity-curve FILE.png`` and
``tools/bench_sched.py``'s capacity part (the figure in docs/scheduler.md). Each replays the
trace once per (capacity, policy) its own way (the CLI in turn, the benchmark in forked
workers); the table, its text and the plot are built here from the summaries.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

#: the sweep of docs/scheduler.md: no pool, 10M and 50M tokens, unbounded (None)
DEFAULT_CAPACITIES_TOKENS: tuple[int | None, ...] = (0, 10_000_000, 50_000_000, None)
#: where "unbounded" is drawn on the plot's x axis (past every finite capacity of the sweep)
UNBOUNDED_PLOT_TOKENS = 200_000_000


def parse_capacities(text: str) -> list[int | None]:
    """``"0,10M,50M,inf"`` -> [0, 10_000_000, 50_000_000, None] (K / M / G suffixes, tokens)."""
    scale = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}
    out: list[int | None] = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        if part in ("inf", "none", "unbounded"):
            out.append(None)
            continue
        factor = scale.get(part[-1], 1)
        number = part[:-1] if part[-1] in scale else part
        try:
            value = int(float(number) * factor)
        except ValueError:
            raise ValueError(f"{part!r} is not a token count (e.g. 0, 10M, inf)") from None
        if value < 0:
            raise ValueError(f"{part!r}: a capacity is >= 0 tokens")
        out.append(value)
    if not out:
        raise ValueError("no capacity given (e.g. 0,10M,50M,inf)")
    return out


def capacity_table(capacities: Sequence[int | None], policies: Sequence[str], rows: Sequence[Any]) -> dict[str, Any]:
    """``rows``: the replays' ``Summary`` objects, capacity-major (every policy at the first
    capacity, then the next). The JSON form of the curve."""
    if len(rows) != len(capacities) * len(policies):
        raise ValueError(f"{len(rows)} replays for {len(capacities)} capacities x {len(policies)} policies")
    ttft: dict[str, list[float]] = {p: [] for p in policies}
    hits: dict[str, list[float]] = {p: [] for p in policies}
    for row in rows:
        ttft[row.policy].append(row.ttft_mean_ms)
        hits[row.policy].append(row.hit_rate)
    return {"capacities_tokens": list(capacities), "ttft_mean_ms": ttft, "hit_rate": hits}


def table_text(curve: dict[str, Any]) -> str:
    """Mean TTFT (ms) and hit rate per policy, one line per capacity."""
    policies = list(curve["ttft_mean_ms"])
    lines = ["pool tokens   " + "  ".join(f"{p:>20}" for p in policies)]
    for i, cap in enumerate(curve["capacities_tokens"]):
        cells = [f"{curve['ttft_mean_ms'][p][i]:>12.0f} ({curve['hit_rate'][p][i]:.1%})" for p in policies]
        lines.append(f"{'inf' if cap is None else cap:>11}   " + "  ".join(cells))
    return "\n".join(lines)


def plot(path: str | pathlib.Path, curve: dict[str, Any]) -> None:
    """The PNG: mean TTFT against pool capacity, one line per policy (matplotlib, headless)."""
    from kvpool.scheduler import plots

    finite = [c for c in curve["capacities_tokens"] if c is not None]
    unbounded = max([UNBOUNDED_PLOT_TOKENS, *(4 * c for c in finite)])
    xs = [c if c is not None else unbounded for c in curve["capacities_tokens"]]
    plots.capacity_curve(path, xs, curve["ttft_mean_ms"])
