"""tools/bench_vllm.py's 0-hit measurement: the two engines' scripts run the same prompts one
at a time in ABBA order (never both at once, neither always second), and the figure is the
median of the per-prompt ratios; the connector's time per phase comes from its counters."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
from bench_vllm import SKIP, WARMUP, summarize_zero_hit, zero_hit_phases

from kvpool.connectors.vllm_testing import connector_counters, connector_times


def run_schedule(scripts: dict[str, list[dict[str, Any]]], outs: dict[str, Path]) -> list[tuple[str, str]]:
    """Play the engines' scripts as ``vllm_testing`` would: each engine runs its phases in
    order, a phase starts only once its ``wait_for`` marker exists, and writes its own marker
    when done. Returns (engine, phase name) in the order they ran; fails on a deadlock."""
    done: set[str] = set()
    next_phase = dict.fromkeys(scripts, 0)
    order: list[tuple[str, str]] = []
    while any(next_phase[e] < len(p) for e, p in scripts.items()):
        ready = [
            e
            for e, phases in scripts.items()
            if next_phase[e] < len(phases)
            and (not phases[next_phase[e]]["wait_for"] or phases[next_phase[e]]["wait_for"] in done)
        ]
        assert ready, f"deadlock after {order}"
        # never two timed prompts at once: at most one engine may start one now
        timed = [e for e in ready if scripts[e][next_phase[e]]["name"].startswith(("zero", "use", "skip"))]
        assert len(timed) <= 1, f"{timed} could both start a timed phase after {order}"
        engine = ready[0]
        phase = scripts[engine][next_phase[engine]]
        order.append((engine, phase["name"]))
        done.add(f"{outs[engine]}.phase{next_phase[engine]}.done")
        next_phase[engine] += 1
    return order


@pytest.mark.parametrize("count", [1, 2, 5])
def test_every_prompt_runs_on_both_engines_one_at_a_time_in_abba_order(tmp_path: Path, count: int) -> None:
    prompts = [[k] * 10 for k in range(count)]
    outs = {"plain": tmp_path / "p.json", "pool": tmp_path / "k.json"}
    own = [[100 + j] * 10 for j in range(2 * count)]
    plain, pool = zero_hit_phases(outs["plain"], outs["pool"], prompts, own, settle_s=1.5)
    for script in (plain, pool):
        assert script[0] == WARMUP and script[1]["name"] == "sync"
        timed = [p for p in script[2:] if p["name"].startswith("zero")]
        assert [p["prompts"] for p in timed] == [[p] for p in prompts]  # the same prompts, in order
        assert all(p["settle_s"] == 1.5 and p["max_tokens"] == 1 for p in script[2:] if p["name"] != "hold")
    order = run_schedule({"plain": plain, "pool": pool}, outs)
    # then the kvpool engine alone: own[2j] with the pool, own[2j + 1] skipping it, ABBA
    inside = [p for p in pool if p["name"].startswith(("use", "skip"))]
    assert [p["name"] for p in inside] == [
        name for j in range(count) for name in ((f"use{j}", f"skip{j}") if j % 2 == 0 else (f"skip{j}", f"use{j}"))
    ]
    for p in inside:
        j = int(p["name"].removeprefix("use").removeprefix("skip"))
        assert p["prompts"] == [own[2 * j + p["name"].startswith("skip")]]
        assert ("kv_transfer_params" in p) == p["name"].startswith("skip")
        assert p.get("kv_transfer_params", SKIP) == SKIP
    assert order.index(("pool", inside[0]["name"])) > max(order.index(("plain", f"zero{k}")) for k in range(count))
    timed_order = [(e, n) for e, n in order if n.startswith("zero")]
    # each timed phase waited for the one before it: a total order, ABBA
    expected: list[tuple[str, str]] = []
    for k in range(count):
        pair = [("plain", f"zero{k}"), ("pool", f"zero{k}")]
        expected += pair if k % 2 == 0 else pair[::-1]
    assert timed_order == expected
    # and none started before both engines had warmed up and synced
    first = order.index(timed_order[0])
    assert {("plain", "sync"), ("pool", "sync")} <= set(order[:first])
    # in the strictly sequential part every timed phase waits for the one before it
    waits = [p["wait_for"] for p in plain[2:] + pool[2:] if p["name"].startswith("zero")]
    assert all(waits) and len(set(waits)) == len(waits)
    # vLLM alone shuts down only after the kvpool engine's last phase (not beside it)
    assert plain[-1]["name"] == "hold" and plain[-1]["prompts"] == []
    assert order.index(("plain", "hold")) > order.index(("pool", pool[-1]["name"]))


def engine_result(
    seconds: list[float], cached: int = 0, connector_s: float | None = None, own: Sequence[tuple[float, float]] = ()
) -> dict[str, Any]:
    """``own``: (with the pool, skipping it) seconds of the in-engine pairs."""
    phases: list[dict[str, Any]] = [{"name": "warmup", "seconds": 9.0, "outputs": []}]
    named = [(f"zero{k}", s) for k, s in enumerate(seconds)]
    named += [(name, s) for j, pair in enumerate(own) for name, s in zip((f"use{j}", f"skip{j}"), pair)]
    for name, s in named:
        phase: dict[str, Any] = {"name": name, "seconds": s, "outputs": [{"seconds": s, "cached": cached}]}
        if connector_s is not None:
            phase["connector_s"] = connector_s
            phase["connector"] = {"load_s": 0.0, "save_s": connector_s / 4, "scheduler_s": 3 * connector_s / 4}
        phases.append(phase)
    return {"phases": phases}


def test_the_figure_is_the_median_of_per_prompt_ratios_over_every_pair() -> None:
    results = [
        engine_result([0.2, 0.2, 0.2]),
        engine_result([0.2, 0.22, 0.4], connector_s=0.004),
        engine_result([0.1, 0.1, 0.1]),
        engine_result([0.1, 0.09, 0.1], connector_s=0.002, own=[(0.11, 0.1), (0.1, 0.1)]),
    ]
    out = summarize_zero_hit(results)
    assert out["own_ratio"] == pytest.approx(1.05) and out["pairs"][1]["own_ratio"] == pytest.approx(1.05)
    assert "own_ratio" not in out["pairs"][0]
    assert [p["ratio"] for p in out["pairs"]] == pytest.approx([1.1, 1.0])
    assert out["ratio"] == pytest.approx(1.0)  # of 1.0, 1.1, 2.0, 1.0, 0.9, 1.0
    assert (out["ratio_min"], out["ratio_max"]) == pytest.approx((0.9, 2.0))
    # the connector's time over the timed phases only (the 9 s warmups are in neither sum)
    assert out["connector_s"] == pytest.approx(3 * 0.004 + 3 * 0.002)
    assert out["engine_s"] == pytest.approx(0.82 + 0.29)
    assert out["pairs"][1]["connector_ms"] == pytest.approx([2.0, 2.0, 2.0])
    assert out["pairs"][1]["connector_median_ms"] == pytest.approx({"load_s": 0.0, "save_s": 0.5, "scheduler_s": 1.5})
    assert out["kvpool_cached_tokens"] == 0


def test_a_hit_in_the_kvpool_engine_is_reported() -> None:
    out = summarize_zero_hit([engine_result([0.2]), engine_result([0.1], cached=2304)])
    assert out["kvpool_cached_tokens"] == 2304


def test_connector_times_sum_both_roles_and_are_zero_before_the_first_write(tmp_path: Path) -> None:
    stats = tmp_path / "stats"
    zero = {"load_s": 0.0, "save_s": 0.0, "scheduler_s": 0.0}
    assert connector_times(str(stats)) == zero and connector_counters(str(stats)) == {}
    assert connector_times("") == zero
    counters = {"load_s": 0.5, "save_s": 0.25, "scheduler_s": 0.0, "lookups": 3}
    Path(f"{stats}.worker.json").write_text(json.dumps(counters))
    assert sum(connector_times(str(stats)).values()) == pytest.approx(0.75)
    Path(f"{stats}.scheduler.json").write_text(json.dumps({"load_s": 0.0, "save_s": 0.0, "scheduler_s": 0.125}))
    assert sum(connector_times(str(stats)).values()) == pytest.approx(0.875)
    assert connector_times(str(stats)) == pytest.approx({"load_s": 0.5, "save_s": 0.25, "scheduler_s": 0.125})
    assert connector_counters(str(stats))["worker"] == counters  # every counter, as written
