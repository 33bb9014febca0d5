"""``kvpool.rpc.http_json``: the HTTP servers' limits (body size, body and reply time,
concurrency), their SSE streams, and their thread: bound to loopback, joined at stop."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvpool.core.errors import InvalidArgument, KVPoolError
from kvpool.rpc.http_json import HttpLimits, HttpServer, StreamFailed, Worker, http_status, json_reply, read_json

WAIT_S = 20.0


class App:
    """A Starlette app with one endpoint per behaviour under test."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.release = threading.Event()  # what /slow waits for
        self.entered = threading.Event()
        self.stream_closed = threading.Event()
        worker = Worker(limits)

        async def echo(request: Request) -> Response:
            try:
                return json_reply(200, await read_json(request, limits))
            except KVPoolError as err:
                return json_reply(http_status(err, 400), {"error": err.message})

        async def slow(request: Request) -> Response:
            def wait() -> dict[str, bool]:
                self.entered.set()
                return {"released": self.release.wait(WAIT_S)}

            try:
                return json_reply(200, await worker.run(wait))
            except KVPoolError as err:
                return json_reply(http_status(err, 500), {"error": err.message})

        def numbers(fail_at: int) -> Iterator[dict[str, int]]:
            try:
                for i in range(1_000_000):
                    if i == fail_at:
                        raise StreamFailed({"error": "failed"})
                    yield {"i": i}
                    if fail_at < 0 and i >= 2:
                        self.release.wait(WAIT_S)  # hold the stream open until the test lets go
            finally:
                self.stream_closed.set()

        async def stream(request: Request) -> Response:
            return worker.events(numbers(int(request.query_params.get("fail_at", "-1"))))

        self.app = Starlette(
            routes=[
                Route("/echo", echo, methods=["POST"]),
                Route("/slow", slow, methods=["GET"]),
                Route("/stream", stream, methods=["GET"]),
            ]
        )


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[tuple[App, HttpServer]]:
    limits = getattr(request, "param", HttpLimits(max_body_bytes=1000, body_timeout_s=1.0, request_timeout_s=1.0))
    before = set(threading.enumerate())
    app = App(limits)
    server = HttpServer(app.app, "127.0.0.1:0", limits, "test")
    server.start()
    try:
        yield app, server
    finally:
        app.release.set()
        server.stop()
    new = [t for t in threading.enumerate() if t not in before]
    for t in new:
        t.join(5)  # an abandoned worker (the 504 test's) ends once released
    assert [t.name for t in new if t.is_alive()] == []  # the server thread and its workers


def connect(server: HttpServer) -> http.client.HTTPConnection:
    host, _, port = server.address.rpartition(":")
    return http.client.HTTPConnection(host, int(port), timeout=WAIT_S)


def post(server: HttpServer, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, object]]:
    conn = connect(server)
    conn.request("POST", "/echo", body, headers or {})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def sse(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    for raw in resp:
        line = raw.strip()
        if line.startswith(b"data:"):
            yield line[5:].strip()


def test_an_empty_host_binds_loopback_and_stop_joins_the_server_thread() -> None:
    limits = HttpLimits()
    server = HttpServer(App(limits).app, ":0", limits, "loopback")
    assert server.address.startswith("127.0.0.1:")
    server.start()
    assert post(server, b'{"a": 1}') == (200, {"a": 1})
    server.stop()
    alive = [t.name for t in threading.enumerate() if t.name == "kvpool-loopback-http"]
    assert alive == []
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(server.address.rpartition(":")[2])), timeout=5).close()


def test_a_port_in_use_is_a_typed_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(InvalidArgument, match="cannot listen"):
            HttpServer(Starlette(), f"127.0.0.1:{port}", HttpLimits(), "busy")


def test_json_bodies_and_their_refusals(served: tuple[App, HttpServer]) -> None:
    _, server = served
    assert post(server, b'{"x": [1, 2]}') == (200, {"x": [1, 2]})
    assert post(server, b"")[0] == 200  # no body: an empty object
    assert post(server, b"[1]") == (400, {"error": "body must be a JSON object"})
    assert post(server, b"{nope")[0] == 400
    assert post(server, b"{}" + b" " * 1000) == (413, {"error": "request body over 1000 bytes"})


def test_a_chunked_body_over_the_limit_is_refused_as_it_passes_it(served: tuple[App, HttpServer]) -> None:
    _, server = served
    conn = connect(server)
    chunks = iter([b'{"a": "' + b"x" * 600, b"y" * 600 + b'"}'])
    conn.request("POST", "/echo", chunks, {"Transfer-Encoding": "chunked"}, encode_chunked=True)
    resp = conn.getresponse()
    assert (resp.status, json.loads(resp.read())) == (413, {"error": "request body over 1000 bytes"})


def test_a_body_that_never_arrives_is_408(served: tuple[App, HttpServer]) -> None:
    _, server = served
    host, _, port = server.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408"), reply


def test_a_reply_not_ready_in_time_is_504(served: tuple[App, HttpServer]) -> None:
    _, server = served
    conn = connect(server)
    conn.request("GET", "/slow")
    resp = conn.getresponse()
    assert resp.status == 504
    assert json.loads(resp.read()) == {"error": "no reply within 1.0 s"}


@pytest.mark.parametrize("served", [HttpLimits(max_concurrent_requests=1, request_timeout_s=WAIT_S)], indirect=True)
def test_requests_beyond_the_concurrency_limit_are_503(served: tuple[App, HttpServer]) -> None:
    app, server = served
    first = connect(server)
    first.request("GET", "/slow")
    assert app.entered.wait(WAIT_S)
    second = connect(server)
    second.request("POST", "/echo", b"{}")
    refused = second.getresponse()
    assert (refused.status, refused.read()) == (503, b"Service Unavailable")
    app.release.set()
    resp = first.getresponse()
    assert (resp.status, json.loads(resp.read())) == (200, {"released": True})
    first.request("POST", "/echo", b'{"again": 1}')  # the slot is free again
    resp = first.getresponse()
    assert (resp.status, json.loads(resp.read())) == (200, {"again": 1})


def test_a_stream_ends_with_done_or_with_its_error_event(served: tuple[App, HttpServer]) -> None:
    _, server = served
    conn = connect(server)
    conn.request("GET", "/stream?fail_at=2")
    resp = conn.getresponse()
    assert resp.getheader("Content-Type") == "text/event-stream"
    assert list(sse(resp)) == [b'{"i": 0}', b'{"i": 1}', b'{"error": "failed"}']  # no [DONE]


def test_a_client_that_goes_away_closes_the_stream_and_stop_joins(served: tuple[App, HttpServer]) -> None:
    app, server = served
    conn = connect(server)
    conn.request("GET", "/stream")
    resp = conn.getresponse()
    events = sse(resp)
    assert [next(events) for _ in range(3)] == [b'{"i": 0}', b'{"i": 1}', b'{"i": 2}']
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    app.release.set()  # the producer's next item finds the client gone
    assert app.stream_closed.wait(WAIT_S)
    server.stop()
    assert "kvpool-test-http" not in {t.name for t in threading.enumerate()}  # (and the fixture checks its workers)


def test_limits_are_checked() -> None:
    with pytest.raises(InvalidArgument):
        HttpLimits(max_body_bytes=0)
    with pytest.raises(InvalidArgument):
        HttpLimits(request_timeout_s=0)
