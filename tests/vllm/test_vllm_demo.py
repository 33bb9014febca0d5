"""``kvpool demo --engine vllm``: two real vLLM OpenAI servers (``kv_producer`` prefill,
``kv_consumer`` decode, ``KvpoolConnector``) behind the router's front door.

One demo, few requests (vLLM takes minutes to start on a loaded CPU): a long prompt goes
through the prefill instance and the pool, streamed; the decode instance's first token is the
prefill instance's; the same prompt forced onto the decode instance alone gives the same
greedy tokens; the prompt's blocks are in the pool; SIGTERM leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvpool.daemon.launcher import free_port
from kvpool.daemon.supervise import same_process_alive

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]


def post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as reply:
        return dict(json.loads(reply.read()))


def stream(port: int, body: dict[str, Any]) -> list[dict[str, Any]]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps({**body, "stream": True}).encode(),
        {"content-type": "application/json"},
    )
    out = []
    with urllib.request.urlopen(req, timeout=600) as reply:
        for raw in reply:
            line = raw.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                out.append(json.loads(line[5:]))
    return out


def test_vllm_prefill_and_decode_through_the_pool_give_the_greedy_tokens(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "kvpool.cli.main", "demo", "--engine", "vllm", "--json"]
    argv += ["--listen", f"127.0.0.1:{port}", "--workdir", str(tmp_path)]
    with open(tmp_path / "demo.stderr", "wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, (tmp_path / "demo.stderr").read_text()[-4000:]
        assert json.loads(line)["engine"] == "vllm"
        procs = json.loads((tmp_path / "demo.json").read_text())["procs"]
        prompt = " ".join(f"w{(i * 37) % 2000}" for i in range(400))  # 3 full 128-token blocks, uncached
        events = stream(port, {"prompt": prompt, "max_tokens": 6})
        final = events[-1]["kvpool"]
        ids = [t for e in events[:-1] for t in e["kvpool"]["token_ids"]]
        assert final["prefill"] == "prefill-0" and len(ids) == 6
        assert final["prefill_first_token"] == ids[:1]  # decode continued from the prefill's KV
        for _ in range(20):  # the pool's KV events reach the router asynchronously
            local = post(port, {"prompt": prompt, "max_tokens": 6, "kvpool": {"route": "local"}})["kvpool"]
            assert local["prefill"] == "decode-local" and local["token_ids"] == ids
            if local["expected_hit_tokens"]:
                break
        assert local["expected_hit_tokens"] == 384  # the router saw the producer's 3 blocks in the pool
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    for p in procs:
        assert not same_process_alive(p["pid"], p["start_ticks"]), p
        assert not p.get("arena_path") or not os.path.exists(p["arena_path"])
