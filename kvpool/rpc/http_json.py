"""The HTTP side the JSON servers share (the router's ``/route`` endpoint, its OpenAI front
door, the reference engine's server): Starlette routes served by uvicorn, JSON bodies in,
JSON replies or an SSE stream out. One place for the request limits and the wire shapes.

Why a framework and not ``http.server``: the stdlib server starts an unbounded thread per
request with no timeout and nothing joins them. Here one event loop thread (``HttpServer``,
started and joined by its owner) serves every connection; the blocking work of a request
(a routing decision, an engine call) runs in a worker thread taken from a bounded pool
(``HttpLimits.max_concurrent_requests``), and anyio joins those before the loop ends.

Limits (``HttpLimits``): a body over ``max_body_bytes`` is 413 (refused from its
``Content-Length`` before a byte is read, or as soon as a chunked body passes it); a body not
in within ``body_timeout_s`` is 408; a non-streamed reply not ready in ``request_timeout_s``
is 504; beyond ``max_concurrent_requests`` connections uvicorn answers 503 at once; an idle
keep-alive connection closes after ``keep_alive_s``.

SSE: ``data: <json>\\n\\n`` per event, ``data: [DONE]\\n\\n`` at the end (chunked encoding, as
OpenAI's streaming clients read). A client that goes away closes the event iterator
(``Worker.events``): its ``finally`` lets go of whatever produced the events.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import anyio
import anyio.to_thread
import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp

from kvpool.core.errors import InvalidArgument, KVPoolError
from kvpool.rpc.listen import split_listen

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
T = TypeVar("T")


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP server admits (module docstring)."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_concurrent_requests: int = 64
    body_timeout_s: float = 30.0
    request_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    shutdown_grace_s: float = 5.0  # open requests get this long at stop, then are cancelled

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0 or self.max_concurrent_requests <= 0:
            raise InvalidArgument("max_body_bytes and max_concurrent_requests must be positive")
        if min(self.body_timeout_s, self.request_timeout_s, self.keep_alive_s, self.shutdown_grace_s) <= 0:
            raise InvalidArgument("HTTP timeouts must be positive")


class BodyTooLarge(InvalidArgument):
    """The request body is over ``HttpLimits.max_body_bytes`` (HTTP 413)."""

    http_status = 413


class BodyTimeout(InvalidArgument):
    """The request body did not arrive within ``HttpLimits.body_timeout_s`` (HTTP 408)."""

    http_status = 408


class StreamFailed(Exception):
    """Raised by an event iterator of ``Worker.events``: send ``event`` (an error) and end
    the stream without ``[DONE]``, so a client cannot take a failed stream for a whole one."""

    def __init__(self, event: dict[str, Any]) -> None:
        super().__init__(event)
        self.event = event


class ReplyTimeout(KVPoolError):
    """The reply was not ready within ``HttpLimits.request_timeout_s`` (HTTP 504)."""

    http_status = 504


def http_status(err: KVPoolError, default: int) -> int:
    """The status a limit error carries, else ``default`` (the server's mapping of ``err``)."""
    return int(getattr(err, "http_status", default))


async def read_json(request: Request, limits: HttpLimits) -> dict[str, Any]:
    """``request``'s body as a JSON object; ``BodyTooLarge``, ``BodyTimeout``, or
    ``InvalidArgument`` for an undecodable or non-object body."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body over {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        with anyio.fail_after(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"request body over {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {limits.body_timeout_s} s") from None
    try:
        body = json.loads(b"".join(chunks) or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("body must be a JSON object")
    return body


def json_reply(status: int, obj: dict[str, Any]) -> Response:
    return JSONResponse(obj, status_code=status)


class Worker:
    """The bounded pool that runs a server's blocking request work off the event loop."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self._limiter: anyio.CapacityLimiter | None = None

    def _pool(self) -> anyio.CapacityLimiter:
        # made on the event loop's thread, the first time a request needs it
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.limits.max_concurrent_requests)
        return self._limiter

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` in a worker thread; ``ReplyTimeout`` after ``request_timeout_s`` (the
        thread finishes on its own: its result is dropped)."""
        try:
            with anyio.fail_after(self.limits.request_timeout_s):
                return await anyio.to_thread.run_sync(fn, limiter=self._pool(), abandon_on_cancel=True)
        except TimeoutError:
            raise ReplyTimeout(f"no reply within {self.limits.request_timeout_s} s") from None

    def events(self, items: Iterator[dict[str, Any]], on_end: Callable[[], None] | None = None) -> StreamingResponse:
        """An SSE reply of ``items`` (each ``next`` runs in a worker thread), ``[DONE]`` after
        the last. However the stream ends (done, failed, the client gone), ``items`` is
        closed and ``on_end`` runs, both in a worker thread."""
        done = object()

        async def body() -> AsyncIterator[bytes]:
            try:
                while True:
                    item = await anyio.to_thread.run_sync(next, items, done, limiter=self._pool())
                    if item is done:
                        break
                    yield _event(cast(dict[str, Any], item))
                yield b"data: [DONE]\n\n"
            except StreamFailed as failed:
                yield _event(failed.event)
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(_close, items, on_end, limiter=self._pool())

        # the content type exactly as OpenAI's servers send it (no charset: Starlette adds one
        # to a text/* media_type, so it is set as a header)
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        return StreamingResponse(body(), headers=headers)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _close(items: Iterator[Any], on_end: Callable[[], None] | None) -> None:
    try:
        close = getattr(items, "close", None)
        if close is not None:
            close()
    finally:
        if on_end is not None:
            on_end()


class HttpServer:
    """``app`` served by uvicorn on one thread this object owns: bound in ``__init__`` (port 0
    picks a free one, ``address`` says which), served from ``start``, and stopped and joined in
    ``stop`` (open requests get ``shutdown_grace_s``; then they are cancelled)."""

    def __init__(self, app: ASGIApp, listen: str, limits: HttpLimits, name: str) -> None:
        host, port = split_listen(listen, f"{name} listen address")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._sock = socket.create_server((host, port), family=family, reuse_port=False)
        except OSError as exc:
            raise InvalidArgument(f"cannot listen on {listen}: {exc.strerror}", hint="is the port in use?") from None
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self.name = name
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            # uvicorn counts the asking connection too: N + 1 admits N at once
            limit_concurrency=limits.max_concurrent_requests + 1,
            timeout_keep_alive=max(1, round(limits.keep_alive_s)),
            timeout_graceful_shutdown=max(1, round(limits.shutdown_grace_s)),
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name=f"kvpool-{self.name}-http", daemon=True
        )
        self._thread.start()

    def stop(self, join_timeout_s: float = 15.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(join_timeout_s)
            if self._thread.is_alive():
                log.warning("%s HTTP server did not stop within %.0f s", self.name, join_timeout_s)
        self._sock.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
