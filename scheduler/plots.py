"""PNG plots of replays (matplotlib imported lazily: the CLI must not pay for it)."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence

import numpy as np


def _plt():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _axes():  # type: ignore[no-untyped-def]
    """A fresh (plt, fig, ax) of the one size every plot here uses."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=90)
    return plt, fig, ax


def _save(plt, fig, ax, path: str | pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    """The common finish: legend, grid, tight layout, write the PNG, free the figure."""
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def ttft_cdf(path: str | pathlib.Path, ttft_by_policy: Mapping[str, np.ndarray], slo_ms: float) -> None:
    plt, fig, ax = _axes()
    for name, x in ttft_by_policy.items():
        x = np.sort(x[~np.isnan(x)]) / 1000.0
        if x.size:
            ax.plot(x, np.arange(1, x.size + 1) / x.size, label=name)
    ax.axvline(slo_ms / 1000.0, color="k", ls="--", lw=0.8, label="TTFT SLO")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, served requests)")
    ax.set_ylabel("CDF")
    _save(plt, fig, ax, path)


def hit_rate_vs_capacity(
    path: str | pathlib.Path,
    capacities_tokens: Sequence[float],
    rates_by_policy: Mapping[str, Sequence[float]],
    oracle: float,
    ylabel: str = "prefix hit rate (% of blocks)",
) -> None:
    plt, fig, ax = _axes()
    for name, rates in rates_by_policy.items():
        ax.plot(np.asarray(capacities_tokens) / 1e6, np.asarray(rates) * 100, marker="o", label=name)
    ax.axhline(oracle * 100, color="k", ls="--", lw=0.8, label="infinite-cache oracle")
    ax.set_xscale("log")
    ax.set_xlabel("global pool capacity (M tokens)")
    ax.set_ylabel(ylabel)
    _save(plt, fig, ax, path)


def goodput_vs_rate(
    path: str | pathlib.Path,
    probes_by_policy: Mapping[str, Sequence[tuple[float, float]]],
    target: float = 0.9,
) -> None:
    plt, fig, ax = _axes()
    for name, probes in probes_by_policy.items():
        pts = sorted(probes)
        ax.plot([p[0] for p in pts], [p[1] * 100 for p in pts], marker="o", label=name)
    ax.axhline(target * 100, color="k", ls="--", lw=0.8, label=f"{target:.0%} SLO attainment")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    _save(plt, fig, ax, path)


def capacity_curve(
    path: str | pathlib.Path,
    capacities_tokens: Sequence[float],
    ttft_by_policy: Mapping[str, Sequence[float]],
    xlabel: str = "global pool capacity (M tokens; rightmost = unbounded)",
) -> None:
    """Mean TTFT per policy against a capacity: where the curves meet, placement stops mattering."""
    plt, fig, ax = _axes()
    for name, ttft in ttft_by_policy.items():
        ax.plot(np.asarray(capacities_tokens) / 1e6, np.asarray(ttft) / 1000.0, marker="o", label=name)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean TTFT (s, served requests)")
    _save(plt, fig, ax, path)
