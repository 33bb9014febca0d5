"""``kvpool sim --capacity-curve FILE.png``: the global pool's capacity swept (the same table
and plot code as tools/bench_sched.py's capacity part), a PNG a person can look at, the
curve as JSON, and bad capacities refused in one line."""

from __future__ import annotations

import json
import pathlib

import pytest
from test_sched_cli import write_trace

from kvpool.cli.main import main
from kvpool.cli.sim_capacity import capacity_table, parse_capacities, table_text


def test_capacities_parse_with_suffixes_and_inf() -> None:
    assert parse_capacities("0, 10M,2.5k,1G,inf") == [0, 10_000_000, 2_500, 1_000_000_000, None]
    for bad in ("", "ten", "-5", "1X"):
        with pytest.raises(ValueError):
            parse_capacities(bad)


def test_the_table_needs_one_replay_per_capacity_and_policy() -> None:
    with pytest.raises(ValueError, match="3 replays for 2 capacities x 2 policies"):
        capacity_table([0, None], ["a", "b"], [object()] * 3)


def test_sim_draws_the_capacity_curve(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace)
    png = tmp_path / "curve.png"
    base = ["sim", "--trace", str(trace), "--policy", "kv-centric-noreject,least-loaded", "--prefill", "2"]
    rc = main([*base, "--decode", "1", "--capacity-curve", str(png), "--capacity-tokens", "0,20k,inf",
               "--json", "--no-progress"])  # fmt: skip
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    curve = doc["capacity_curve"]
    assert doc["requests"] == 40 and curve["capacities_tokens"] == [0, 20_000, None]
    assert set(curve["ttft_mean_ms"]) == {"kv-centric-noreject", "least-loaded"}
    assert all(len(v) == 3 and all(t > 0 for t in v) for v in curve["ttft_mean_ms"].values())
    assert all(0.0 <= h <= 1.0 for v in curve["hit_rate"].values() for h in v)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    lines = table_text(curve).splitlines()
    assert len(lines) == 4 and lines[-1].split()[0] == "inf"

    rc = main([*base, "--capacity-curve", str(png), "--capacity-tokens", "lots", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--capacity-tokens" in err and "'lots'" in err
    for where, why in ((tmp_path, "is a directory"), (tmp_path / "no" / "c.png", "no directory")):
        assert main([*base, "--capacity-curve", str(where), "--no-progress"]) == 2  # refused before any replay
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err
