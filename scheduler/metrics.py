"""Summaries of a replay: hit rates against the oracle, latency percentiles, SLO
attainment, goodput, bytes moved, decision time.

Conventions (kept in one place so every table means the same thing):
* hit rate = prefix blocks found (local + pool + peer) / prompt blocks, over the
  requests that were served; ``oracle_fraction`` = blocks found / blocks an
  infinite cache would have found *for the same served requests* (so rejecting
  the uncacheable requests cannot inflate it); ``oracle_hit_rate`` is the
  infinite-cache rate over the whole trace;
* SLO attainment = requests served with TTFT <= SLO and TPOT <= SLO / *all*
  requests (a rejection counts as a miss, so rejecting cannot inflate it);
* goodput = the highest request rate at which attainment >= 90%.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvpool.scheduler.cluster import Slo
from kvpool.scheduler.simulator import RequestOutcome


def pct(x: np.ndarray, q: float) -> float:
    x = x[~np.isnan(x)]
    return float(np.percentile(x, q)) if x.size else float("nan")


@dataclass(frozen=True)
class Summary:
    policy: str
    speedup: float
    rate_rps: float
    requests: int
    served: int
    rejected: int
    rejected_input_tokens: int
    rejected_token_share: float  # rejected input tokens / all input tokens
    hit_rate: float
    hit_local: float
    hit_pool: float
    hit_peer: float
    oracle_hit_rate: float
    oracle_fraction: float
    recomputed_tokens: int
    ttft_mean_ms: float  # over served requests
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_p90_all_ms: float  # over all requests, a rejection counted as an infinite TTFT
    tpot_p50_ms: float
    tpot_p90_ms: float
    tpot_p99_ms: float
    pause_p99_ms: float  # the longest extra gap between two tokens of a request (local prefills), p99
    slo_attainment: float
    kv_bytes_moved: float
    decision_p50_us: float
    decision_p99_us: float
    sim_end_ms: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    policy: str,
    out: RequestOutcome,
    slo: Slo,
    oracle_blocks: np.ndarray,
    speedup: float,
    base_rate_rps: float,
    sim_end_ms: float,
) -> Summary:
    """``oracle_blocks``: per-request infinite-cache hit blocks (``trace.oracle_hit_blocks``)."""
    served = ~out.rejected
    oracle_hit_rate = float(oracle_blocks.sum()) / max(1, int(out.blocks.sum()))
    oracle_served = int(oracle_blocks[served].sum())
    blocks = int(out.blocks[served].sum())
    hl, hp, hr = (int(a[served].sum()) for a in (out.hit_local, out.hit_pool, out.hit_peer))
    denom = max(1, blocks)
    hit = (hl + hp + hr) / denom
    ok = served & (out.ttft_ms <= slo.ttft_ms) & (out.tpot_ms <= slo.tpot_ms)
    dec_us = out.decision_ns / 1000.0
    return Summary(
        policy=policy,
        speedup=speedup,
        rate_rps=base_rate_rps * speedup,
        requests=out.n,
        served=int(served.sum()),
        rejected=int(out.rejected.sum()),
        rejected_input_tokens=int(out.input_tokens[out.rejected].sum()),
        rejected_token_share=float(out.input_tokens[out.rejected].sum()) / max(1, int(out.input_tokens.sum())),
        hit_rate=hit,
        hit_local=hl / denom,
        hit_pool=hp / denom,
        hit_peer=hr / denom,
        oracle_hit_rate=oracle_hit_rate,
        oracle_fraction=(hl + hp + hr) / oracle_served if oracle_served else float("nan"),
        recomputed_tokens=int(out.new_tokens[served].sum()),
        ttft_mean_ms=float(np.nanmean(out.ttft_ms)) if served.any() else float("nan"),
        ttft_p50_ms=pct(out.ttft_ms, 50),
        ttft_p90_ms=pct(out.ttft_ms, 90),
        ttft_p99_ms=pct(out.ttft_ms, 99),
        ttft_p90_all_ms=float(np.quantile(np.where(out.rejected, np.inf, out.ttft_ms), 0.9, method="higher")),
        tpot_p50_ms=pct(out.tpot_ms, 50),
        tpot_p90_ms=pct(out.tpot_ms, 90),
        tpot_p99_ms=pct(out.tpot_ms, 99),
        pause_p99_ms=pct(out.max_pause_ms, 99),
        slo_attainment=float(ok.sum()) / max(1, out.n),
        kv_bytes_moved=float(np.nansum(out.bytes_moved)),
        decision_p50_us=float(np.percentile(dec_us, 50)),
        decision_p99_us=float(np.percentile(dec_us, 99)),
        sim_end_ms=sim_end_ms,
    )


def goodput_search(
    attainment_at: Callable[[float], float],
    *,
    lo: float = 0.25,
    hi: float = 16.0,
    target: float = 0.9,
    steps: int = 6,
) -> tuple[float, list[tuple[float, float]]]:
    """Highest speed-up with attainment >= target: geometric bracket then bisection.

    Returns (speed-up, [(speed-up, attainment) probed]); 0.0 when even ``lo`` fails.
    Attainment is assumed to fall with load (it is re-checked only by probing).
    """
    probes: list[tuple[float, float]] = []

    def probe(s: float) -> bool:
        a = attainment_at(s)
        probes.append((s, a))
        return a >= target

    if not probe(lo):
        return 0.0, probes
    good, bad = lo, None
    s = lo
    while s < hi:
        s = min(hi, s * 2)
        if probe(s):
            good = s
        else:
            bad = s
            break
    if bad is None:
        return good, probes
    for _ in range(steps):
        mid = (good * bad) ** 0.5
        if probe(mid):
            good = mid
        else:
            bad = mid
    return good, probes


def format_table(rows: list[Summary]) -> str:
    """A plain terminal table of summaries (times in ms; "p90 all" counts a rejection as infinite)."""
    head = [
        "policy",
        "x",
        "req/s",
        "hit",
        "local",
        "pool",
        "peer",
        "/oracle",
        "rej",
        "rej tok",
        "recomp Mtok",
        "TTFT mean",
        "TTFT p50",
        "p90",
        "p99",
        "p90 all",
        "TPOT p50",
        "p90",
        "p99",
        "SLO ok",
        "moved GB",
        "dec p99 us",
    ]
    lines = []
    for r in rows:
        lines.append(
            [
                r.policy,
                f"{r.speedup:g}",
                f"{r.rate_rps:.2f}",
                f"{r.hit_rate:.1%}",
                f"{r.hit_local:.1%}",
                f"{r.hit_pool:.1%}",
                f"{r.hit_peer:.1%}",
                f"{r.oracle_fraction:.1%}",
                str(r.rejected),
                f"{r.rejected_token_share:.1%}",
                f"{r.recomputed_tokens / 1e6:.1f}",
                f"{r.ttft_mean_ms:.0f}",
                f"{r.ttft_p50_ms:.0f}",
                f"{r.ttft_p90_ms:.0f}",
                f"{r.ttft_p99_ms:.0f}",
                f"{r.ttft_p90_all_ms:.0f}",
                f"{r.tpot_p50_ms:.1f}",
                f"{r.tpot_p90_ms:.1f}",
                f"{r.tpot_p99_ms:.1f}",
                f"{r.slo_attainment:.1%}",
                f"{r.kv_bytes_moved / 1e9:.0f}",
                f"{r.decision_p99_us:.0f}",
            ]
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" if i else f"{{:<{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths)), *(fmt.format(*ln) for ln in lines)])
