"""PNG plots of ``kvpool demo bench``: inter-token latency over time (the stalls a long
prefill causes when colocated) and the TTFT CDF, per mode, one pair per workload.
matplotlib is optional: without it no plot is written (and the bench says so)."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np


def plot_results(results: dict[str, dict[str, Any]], out_dir: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("kvpool demo bench: matplotlib is not installed, no plots", file=sys.stderr)
        return []
    paths = []
    for workload, by_mode in results.items():
        fig, (ax_itl, ax_cdf) = plt.subplots(1, 2, figsize=(12, 4.2))
        for mode, r in by_mode.items():
            itl = np.asarray(r["series"]["itl"]).reshape(-1, 2)
            if len(itl):
                order = np.argsort(itl[:, 0])
                ax_itl.plot(itl[order, 0], itl[order, 1], ".", ms=2.5, label=mode, alpha=0.7)
            ttft = np.sort(np.asarray(r["series"]["ttft_ms"]))
            if len(ttft):
                ax_cdf.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", label=mode)
        ax_itl.set(xlabel="time since start (s)", ylabel="inter-token latency (ms)", yscale="log")
        ax_itl.set_title(f"{workload}: ITL of every token")
        ax_cdf.set(xlabel="TTFT (ms)", ylabel="fraction of requests", xscale="log")
        # a range within one decade would label every minor tick (2x10^1, 3x10^1, ...) on top of each other
        ax_cdf.xaxis.set_minor_formatter(plt.NullFormatter())
        ax_cdf.set_title(f"{workload}: TTFT CDF")
        for ax in (ax_itl, ax_cdf):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"demo_{workload}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
