"""``kvpool demo`` with the reference engine, as a user runs it: pool, 1 prefill + 2 decode
engine processes, the router's OpenAI front door, all on loopback.

* the front door serves streaming completions and chat completions, and ``/v1/models``;
* a long prompt goes to the prefill instance and the decode instance loads its KV from the
  pool; the same prompt again prefills on the decode instance from the pool (well-cached);
* greedy decoding gives the same tokens whichever path a request takes (decode-local,
  prefill instance + pool, auto) and the same as one colocated engine, chunked or not;
* a killed decode instance fails *its* stream with a clear error, the other stream
  completes, later requests are served by the live instance, and the demo keeps running.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.daemon.launcher import free_port
from kvpool.daemon.supervise import same_process_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LONG = 300  # tokens: over --local-prefill-tokens 128, so it prefills on the prefill instance


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("demo")
    port = free_port()
    argv = [sys.executable, "-m", "kvpool.cli.main", "demo", "--engine", "ref", "--decode", "2", "--json"]
    argv += ["--listen", f"127.0.0.1:{port}", "--local-prefill-tokens", "128", "--workdir", str(workdir)]
    stderr = open(workdir / "demo.stderr", "w+")  # noqa: SIM115 - read by the tests, closed below
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, (workdir / "demo.stderr").read_text()
    info = json.loads(line)
    procs = json.loads((workdir / "demo.json").read_text())["procs"]
    yield {**info, "port": port, "proc": proc, "procs": procs, "stderr": workdir / "demo.stderr"}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    stderr.close()
    for p in procs:
        assert not same_process_alive(p["pid"], p["start_ticks"]), p
        assert not p.get("arena_path") or not os.path.exists(p["arena_path"])


def post(demo: dict[str, Any], path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", demo["port"], timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def events(demo: dict[str, Any], path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The SSE events of a streamed request (``[DONE]`` ends it)."""
    conn = http.client.HTTPConnection("127.0.0.1", demo["port"], timeout=120)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.getheader("Content-Type") == "text/event-stream"
    for raw in resp:
        line = raw.strip()
        if line.startswith(b"data:"):
            if line[5:].strip() == b"[DONE]":
                return
            yield json.loads(line[5:])


def words(n: int, start: int = 0) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


def test_streaming_completion_and_chat_through_the_front_door(demo: dict[str, Any]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", demo["port"], timeout=30)
    conn.request("GET", "/v1/models")
    assert json.loads(conn.getresponse().read())["data"][0]["id"] == "kvpool-demo"
    got = list(events(demo, "/v1/completions", {"prompt": "w1 w2 w3", "max_tokens": 6}))
    text = "".join(e["choices"][0]["text"] for e in got)
    assert len(text.split()) == 6 and all(w.startswith("w") for w in text.split())
    assert got[-1]["choices"][0]["finish_reason"] == "length"
    assert got[-1]["kvpool"]["prefill"] == "decode-local"  # 3 tokens: no second hop
    chat = list(
        events(demo, "/v1/chat/completions", {"messages": [{"role": "user", "content": "w7"}], "max_tokens": 4})
    )
    assert chat[0]["object"] == "chat.completion.chunk" and chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len("".join(e["choices"][0]["delta"].get("content", "") for e in chat).split()) == 4


def test_long_prompt_prefills_remotely_then_reuses_the_pool(demo: dict[str, Any]) -> None:
    prompt = words(LONG, start=500)
    status, first = post(demo, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
    assert status == 200, first
    kv = first["kvpool"]
    assert kv["prefill"] == "prefill-0"
    assert kv["hit_tokens"] == (LONG - 1) // 32 * 32  # the decode instance loaded every full block
    assert kv["prefill_first_token"] == kv["token_ids"][:1]
    # the pool's KV events reach the router: the same prefix is now well-cached -> decode-local
    for _ in range(50):
        status, again = post(demo, "/v1/completions", {"prompt": prompt + " w9", "max_tokens": 4})
        if again["kvpool"]["expected_hit_tokens"]:
            break
    assert again["kvpool"]["prefill"] == "decode-local" and again["kvpool"]["hit_tokens"] >= LONG // 32 * 32 - 32


def test_greedy_tokens_are_the_same_on_every_path_and_colocated(demo: dict[str, Any]) -> None:
    import torch

    from kvpool.core.words import WordTokenizer
    from kvpool.engine.engine import Engine, EngineConfig, SamplingParams
    from kvpool.engine.model import ModelConfig, RefModel

    prompts = [words(5, 40), words(LONG, 900), words(LONG, 900) + " " + words(70, 10), words(200, 1)]
    by_route: dict[str, list[list[int]]] = {}
    for route in ("remote", "local", "auto"):
        outs = []
        for p in prompts:
            status, reply = post(demo, "/v1/completions", {"prompt": p, "max_tokens": 8, "kvpool": {"route": route}})
            assert status == 200, reply
            assert route == "auto" or reply["kvpool"]["prefill"] == (
                "prefill-0" if route == "remote" else "decode-local"
            )
            outs.append(reply["kvpool"]["token_ids"])
        by_route[route] = outs
    assert by_route["remote"] == by_route["local"] == by_route["auto"]
    torch.set_num_threads(1)
    model = RefModel(ModelConfig())
    tok = WordTokenizer.for_vocab(model.config.vocab_size)
    for chunk in (None, 64):  # colocated, and colocated with chunked prefill: no pool at all
        engine = Engine(model.config, EngineConfig(chunk_tokens=chunk), model=model)
        reqs = [engine.add_request(str(i), tok.encode(p), SamplingParams(8)) for i, p in enumerate(prompts)]
        engine.run_until_done()
        assert [r.output for r in reqs] == by_route["auto"], chunk


def test_a_killed_decode_instance_fails_its_stream_and_the_rest_go_on(demo: dict[str, Any]) -> None:
    streams = [events(demo, "/v1/completions", {"prompt": words(8, k), "max_tokens": 400}) for k in (1, 2)]
    firsts = [next(s) for s in streams]  # both are streaming now, one on each decode instance
    where = [f["kvpool"]["decode"] for f in firsts]
    assert sorted(where) == ["decode-0", "decode-1"]
    victim = where[0]
    pid = next(p["pid"] for p in demo["procs"] if p["name"] == victim)
    os.kill(pid, signal.SIGKILL)
    results: dict[int, list[dict[str, Any]]] = {}
    threads = [threading.Thread(target=lambda i=i: results.setdefault(i, list(streams[i]))) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    killed, alive = results[0], results[1]
    assert "error" in killed[-1]
    message = killed[-1]["error"]["message"]
    assert killed[-1]["error"]["type"] == "engine_unavailable" and f"decode instance {victim}" in message
    assert sum(len(e.get("kvpool", {}).get("token_ids", [])) for e in [firsts[1], *alive]) == 400
    assert alive[-1]["choices"][0]["finish_reason"] == "length"
    for k in range(3):  # later requests: served by the live instance
        status, reply = post(demo, "/v1/completions", {"prompt": words(6, 30 + k), "max_tokens": 3})
        assert status == 200 and reply["kvpool"]["decode"] == where[1], reply
    assert demo["proc"].poll() is None  # the demo goes on
    assert f"{victim} (pid {pid}) exited" in Path(demo["stderr"]).read_text()
