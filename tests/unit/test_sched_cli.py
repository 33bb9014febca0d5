"""`kvpool sim` end to end on a tiny trace: the table, --json, --plots, and bad input."""

from __future__ import annotations

import json
import pathlib

import pytest

from kvpool.cli.main import main


def write_trace(path: pathlib.Path, n: int = 40) -> None:
    lines = []
    for i in range(n):
        ids = [0, *range(1 + (i % 5) * 10, 1 + (i % 5) * 10 + 1 + i // 5)]
        lines.append(
            json.dumps(
                {"timestamp": i * 500, "input_length": len(ids) * 512 - 100, "output_length": 20, "hash_ids": ids}
            )
        )
    path.write_text("\n".join(lines) + "\n")


def test_sim_json_and_plots(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace)
    rc = main(
        [
            "sim",
            "--trace",
            str(trace),
            "--policy",
            "kv-centric,least-loaded",
            "--prefill",
            "2",
            "--decode",
            "1",
            "--json",
            "--no-progress",
            "--plots",
            str(tmp_path / "plots"),
        ]
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in doc["results"]] == ["kv-centric", "least-loaded"]
    for r in doc["results"]:
        assert r["requests"] == 40 and r["served"] + r["rejected"] == 40 and 0 < r["hit_rate"] < 1
    assert (tmp_path / "plots" / "ttft_cdf.png").stat().st_size > 1000


def test_sim_table_and_progress(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace)
    assert main(["sim", "--trace", str(trace), "--policy", "round-robin", "--prefill", "2", "--decode", "1"]) == 0
    out = capsys.readouterr()
    assert "round-robin" in out.out and "TTFT p50" in out.out
    assert "40/40" in out.err  # the progress bar reached the end


def test_sim_bad_input_is_a_clear_error(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 10}) + "\n")
    assert main(["sim", "--trace", str(trace), "--no-progress"]) == 2
    assert "missing field" in capsys.readouterr().err
    write_trace(trace)
    assert main(["sim", "--trace", str(trace), "--decode", "0", "--no-progress"]) == 2
    assert "no decode instance" in capsys.readouterr().err
    assert main(["sim", "--trace", str(trace), "--policy", "bogus", "--no-progress"]) == 2


def test_sim_generated_workload_writes_a_trace_that_replays_the_same(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_trace = tmp_path / "agent.jsonl"
    common = ["--policy", "kv-centric-noreject", "--prefill", "2", "--decode", "1", "--json", "--no-progress"]
    opts = ["--workload-opt", "requests=60,rate_rps=2", "--workload-opt", "turn_tokens=200:900"]
    assert main(["sim", "--workload", "agent", *opts, "--write-trace", str(out_trace), *common]) == 0
    generated = json.loads(capsys.readouterr().out)["results"][0]
    lines = out_trace.read_text().splitlines()
    assert len(lines) == 60 and set(json.loads(lines[0])) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert main(["sim", "--trace", str(out_trace), *common]) == 0
    replayed = json.loads(capsys.readouterr().out)["results"][0]
    assert replayed["ttft_mean_ms"] == generated["ttft_mean_ms"] and replayed["hit_rate"] == generated["hit_rate"]
    assert generated["hit_rate"] > 0.3  # long shared prefixes


def test_sim_unknown_workload_knob_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--workload", "chat", "--workload-opt", "sessions=3", "--no-progress"]) == 2
    assert "unknown workload knob" in capsys.readouterr().err
