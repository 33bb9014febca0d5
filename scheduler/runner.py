"""Composable runs for the CLI and the tools: one policy at one load, a goodput
search, a capacity sweep. One ``TraceHasher`` is shared across runs so each block
id is hashed once per process."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.scheduler.cluster import ClusterSpec, Slo
from kvpool.scheduler.cost_model import CostModel
from kvpool.scheduler.metrics import Summary, goodput_search, summarize
from kvpool.scheduler.policies import make_policy
from kvpool.scheduler.policy_base import Policy
from kvpool.scheduler.simulator import RequestOutcome, Simulator
from kvpool.scheduler.trace import TraceHasher, TraceRequest, oracle_hit_blocks


@dataclass
class Workload:
    """A trace with what every run of it shares."""

    trace: Sequence[TraceRequest]
    hasher: TraceHasher
    oracle_blocks: np.ndarray
    base_rate_rps: float

    @classmethod
    def of(cls, trace: Sequence[TraceRequest]) -> Workload:
        span_s = max(1e-3, (trace[-1].arrival_ms - trace[0].arrival_ms) / 1000.0)
        return cls(trace, TraceHasher(), oracle_hit_blocks(trace), len(trace) / span_s)

    def prehash(self) -> None:
        """Hash every block id once now: before a pool of worker processes forks, so each worker
        starts with the cache instead of hashing the whole trace again."""
        for r in self.trace:
            self.hasher.hashes(r.block_ids)


def progress_bar(label: str, stream=None) -> Callable[[int, int], None]:  # type: ignore[no-untyped-def]
    """A simple stderr progress bar (carriage return, no dependency)."""
    out = stream or sys.stderr

    def show(done: int, total: int) -> None:
        width = 30
        filled = width * done // max(1, total)
        out.write(f"\r{label:<22} [{'#' * filled}{' ' * (width - filled)}] {done}/{total}")
        if done >= total:
            out.write("\n")
        out.flush()

    return show


def run_policy(
    work: Workload,
    spec: ClusterSpec,
    cost: CostModel,
    policy: str | Policy,
    slo: Slo,
    *,
    speedup: float = 1.0,
    seed: int = 0,
    progress: bool = False,
    role_costs: Mapping[str, CostModel] | None = None,
) -> tuple[Summary, RequestOutcome]:
    """One replay of a registered policy (by name) or of a policy object (an ablation, a variant);
    ``role_costs`` gives prefill / decode / remote instances their own hardware."""
    name = policy if isinstance(policy, str) else policy.name
    sim = Simulator(
        spec,
        cost,
        make_policy(policy, seed) if isinstance(policy, str) else policy,
        slo,
        speedup=speedup,
        hasher=work.hasher,
        progress=progress_bar(f"{name} x{speedup:g}") if progress else None,
        role_costs=role_costs,
    )
    out = sim.run(work.trace)
    return summarize(name, out, slo, work.oracle_blocks, speedup, work.base_rate_rps, sim.last_time_ms), out


def goodput(
    work: Workload,
    spec: ClusterSpec,
    cost: CostModel,
    policy: str,
    slo: Slo,
    *,
    seed: int = 0,
    lo: float = 0.25,
    hi: float = 16.0,
    steps: int = 5,
    progress: bool = False,
) -> tuple[float, list[tuple[float, float]]]:
    """(goodput in req/s, [(req/s, attainment) probed])."""

    def attainment(speedup: float) -> float:
        s, _ = run_policy(work, spec, cost, policy, slo, speedup=speedup, seed=seed, progress=progress)
        return s.slo_attainment

    best, probes = goodput_search(attainment, lo=lo, hi=hi, steps=steps)
    r = work.base_rate_rps
    return best * r, [(s * r, a) for s, a in probes]


def capacity_sweep(
    work: Workload,
    spec: ClusterSpec,
    cost: CostModel,
    policy: str,
    slo: Slo,
    pool_tokens: Sequence[int | None],
    *,
    speedup: float = 1.0,
    seed: int = 0,
    progress: bool = False,
) -> list[Summary]:
    """One run per global pool capacity (tokens; None = unbounded)."""
    rows = []
    for tokens in pool_tokens:
        blocks = None if tokens is None else tokens // spec.block_tokens
        s, _ = run_policy(
            work,
            dataclasses.replace(spec, pool_blocks=blocks),
            cost,
            policy,
            slo,
            speedup=speedup,
            seed=seed,
            progress=progress,
        )
        rows.append(s)
    return rows
