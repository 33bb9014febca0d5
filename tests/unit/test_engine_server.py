"""The reference engine's HTTP server: completions whole and streamed, and a client that
goes away mid-stream stops the engine's work for it (its pages come back)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvpool.core.words import WordTokenizer
from kvpool.engine.engine import Engine, EngineConfig
from kvpool.engine.model import ModelConfig
from kvpool.engine.server import ENGINE_HTTP_LIMITS, EngineLoop, engine_app
from kvpool.rpc.http_json import HttpServer

torch.set_num_threads(2)
MC = ModelConfig(vocab_size=256, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)
WAIT_S = 30.0


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


@pytest.fixture
def engine_server() -> Iterator[tuple[EngineLoop, HttpServer]]:
    engine = Engine(MC, EngineConfig(num_pages=1100, page_tokens=4, block_tokens=8, role="both"))
    loop = EngineLoop(engine)
    server = HttpServer(engine_app(loop, "m", WordTokenizer.for_vocab(MC.vocab_size)), "127.0.0.1:0",
                        ENGINE_HTTP_LIMITS, "engine")  # fmt: skip
    loop.start()
    server.start()
    try:
        yield loop, server
    finally:
        server.stop()
        loop.stop()
    assert {t.name for t in threading.enumerate()} & {"kvpool-engine-http", "engine-loop"} == set()


def connect(server: HttpServer) -> http.client.HTTPConnection:
    host, _, port = server.address.rpartition(":")
    return http.client.HTTPConnection(host, int(port), timeout=WAIT_S)


def test_whole_and_streamed_completions_agree(engine_server: tuple[EngineLoop, HttpServer]) -> None:
    _, server = engine_server
    body = {"prompt": list(range(1, 20)), "max_tokens": 6}
    conn = connect(server)
    conn.request("POST", "/v1/completions", json.dumps(body))
    whole = json.loads(conn.getresponse().read())
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}))
    resp = conn.getresponse()
    data = [line[5:].strip() for line in resp.read().splitlines() if line.startswith(b"data:")]
    assert data[-1] == b"[DONE]"
    streamed = [t for d in data[:-1] for t in json.loads(d)["choices"][0]["token_ids"]]
    assert streamed == whole["choices"][0]["token_ids"] and len(streamed) == 6


def test_a_client_gone_mid_stream_frees_its_pages(engine_server: tuple[EngineLoop, HttpServer]) -> None:
    loop, server = engine_server
    engine = loop.engine
    free_at_start = engine.allocator.free_pages
    conn = connect(server)
    body = {"prompt": list(range(1, 40)), "max_tokens": 4000, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200
    got = 0
    for raw in resp:
        got += raw.startswith(b"data:")
        if got == 3:
            break
    assert engine.allocator.free_pages < free_at_start  # the request holds its pages now
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(lambda: not engine.running and not engine.waiting, "the engine dropped the abandoned request")
    assert engine.allocator.free_pages == free_at_start
    assert engine.finished == []  # it was dropped, never ran to its 4000 tokens


def test_a_request_larger_than_the_engine_is_refused_and_the_engine_serves_on(
    engine_server: tuple[EngineLoop, HttpServer],
) -> None:
    loop, server = engine_server
    conn = connect(server)
    too_big = {"prompt": [t % 200 for t in range(400)], "max_tokens": 4096}  # 1124 pages of 4 tokens
    conn.request("POST", "/v1/completions", json.dumps(too_big))
    resp = conn.getresponse()
    assert resp.status == 400
    assert json.loads(resp.read())["error"]["type"] == "CapacityExhausted"
    conn.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}))
    resp = conn.getresponse()
    assert resp.status == 200 and len(json.loads(resp.read())["choices"][0]["token_ids"]) == 2
    assert loop.error is None
