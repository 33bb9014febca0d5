"""Prefill and decode workers in separate processes hand KV over through a real pool daemon."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from kvpool.engine.engine import Engine, EngineConfig, SamplingParams
from kvpool.engine.model import ModelConfig

torch.set_num_threads(2)
REPO = Path(__file__).resolve().parents[2]


def _worker(role: str, address: str, requests: list[dict[str, object]], tmp: Path) -> list[dict[str, object]]:
    src, out = tmp / f"{role}-in.json", tmp / f"{role}-out.json"
    src.write_text(json.dumps(requests))
    cmd = [sys.executable, "-m", "kvpool.engine.worker", "--role", role, "--pool", address, "--salt", "pd"]
    cmd += ["--requests", str(src), "--out", str(out), "--threads", "1", "--chunk-tokens", "48"]
    subprocess.run(cmd, cwd=REPO, check=True, timeout=120)
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_prefill_worker_to_decode_worker_through_daemon(pool_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (150, 97)]
    specs = [
        {"id": "greedy", "prompt": prompts[0], "max_new_tokens": 6},
        {"id": "sampled", "prompt": prompts[1], "max_new_tokens": 6, "temperature": 0.8, "top_k": 50, "seed": 11},
    ]
    prefilled = _worker("prefill", pool_daemon.address, specs, tmp_path)
    assert [r["hit_tokens"] for r in prefilled] == [0, 0]
    assert [r["prefill_tokens_run"] for r in prefilled] == [150, 97]
    handoff = [
        {**s, "prompt": s["prompt"] + r["output"], "max_new_tokens": 5}  # type: ignore[operator]
        for s, r in zip(specs, prefilled)
    ]
    decoded = _worker("decode", pool_daemon.address, handoff, tmp_path)
    # the decode worker ran only what the pool could not give it: the prompt's partial tail + first token
    assert [r["hit_tokens"] for r in decoded] == [128, 96]
    assert [r["prefill_tokens_run"] for r in decoded] == [151 - 128, 98 - 96]
    assert all(r["load_errors"] == 0 for r in decoded)

    # one engine, no pool, same requests: the PD pair produced exactly the same tokens
    alone = Engine(ModelConfig(), EngineConfig(num_pages=256))
    for s in specs:
        params = SamplingParams(6, float(s.get("temperature", 0.0)), int(s.get("top_k", 0)), int(s.get("seed", 0)))  # type: ignore[arg-type,call-overload]
        alone.add_request(str(s["id"]), list(s["prompt"]), params)  # type: ignore[call-overload]
    outputs = {r.request_id: r.output for r in alone.run_until_done()}
    for p, d in zip(prefilled, decoded):
        assert p["output"] + d["output"] == outputs[str(p["id"])]  # type: ignore[operator]
