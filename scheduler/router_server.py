"""The router daemon's transports: gRPC (``kvpool.router.v1.Router``) and a small
HTTP/JSON endpoint, both over one ``RouterCore``, both bound to loopback by default.

HTTP (Starlette on uvicorn, ``kvpool.rpc.http_json``: body, concurrency and time limits):
  POST /route   {"token_ids": [...]} or {"hashes": ["hex", ...], "input_tokens": n},
                "output_tokens": m, "slo": {"ttft_ms": .., "tpot_ms": ..}   -> decision
  POST /report  {"instance": "prefill-0", "queue_ms": .., ...}               -> {}
  GET  /stats                                                                 -> counters
  GET  /metrics                                     -> Prometheus text format (docs/metrics.md)
Errors come back as {"error": CODE, "message", "hint"} with a 4xx/5xx status.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from concurrent import futures
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvpool.core.errors import ErrorCode, InvalidArgument, KVPoolError, NotFound
from kvpool.core.hashing import unpack_hashes
from kvpool.proto import router_pb2, router_pb2_grpc
from kvpool.rpc.codec import server_options
from kvpool.rpc.errors import typed_handler
from kvpool.rpc.http_json import HttpLimits, HttpServer, Worker, http_status, json_reply, read_json
from kvpool.rpc.metrics import ServiceMetrics, exposition
from kvpool.scheduler.cluster import Slo
from kvpool.scheduler.router_core import RouterCore, RouteResult, WorkerLoad
from kvpool.scheduler.router_metrics import HttpMetrics, RouterCollector

log = logging.getLogger(__name__)

_HTTP_STATUS = {ErrorCode.INVALID_ARGUMENT: 400, ErrorCode.NOT_FOUND: 404, ErrorCode.UNAVAILABLE: 503}
# a /route body carries a prompt's token ids or hashes: room for a long context
ROUTER_HTTP_LIMITS = HttpLimits(max_body_bytes=64 << 20, request_timeout_s=30.0)


def _slo(core: RouterCore, ttft_ms: float, tpot_ms: float) -> Slo:
    d = core.default_slo
    return Slo(ttft_ms or d.ttft_ms, tpot_ms or d.tpot_ms)


def result_to_dict(r: RouteResult) -> dict[str, Any]:
    d = r.decision
    return {
        "rejected": d.rejected,
        "reason": d.reason,
        "prefill_kind": "" if d.rejected else d.prefill_kind,
        "prefill_instance": r.prefill_instance,
        "decode_instance": r.decode_instance,
        "expected_hit_blocks": d.expected_hit_blocks,
        "expected_hit_tokens": r.expected_hit_tokens,
        "expected_ttft_ms": d.expected_ttft_ms,
        "expected_tpot_ms": d.expected_tpot_ms,
        "decision_us": r.decision_us,
    }


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    @typed_handler
    def Route(self, request: router_pb2.RouteRequest, context: grpc.ServicerContext) -> router_pb2.RouteReply:
        core = self.core
        slo = _slo(core, request.slo.ttft_ms, request.slo.tpot_ms)
        hashes = unpack_hashes(request.hashes) if request.hashes else None
        req = core.request_from(
            list(request.token_ids) or None,
            hashes,
            request.input_tokens,
            request.output_tokens,
            slo,
            request.request_id,
        )
        return router_pb2.RouteReply(**result_to_dict(core.route(req)))

    @typed_handler
    def Report(self, request: router_pb2.WorkerReport, context: grpc.ServicerContext) -> router_pb2.ReportReply:
        self.core.report(
            WorkerLoad(
                request.instance,
                request.queue_ms,
                request.outstanding_requests,
                request.outstanding_tokens,
                request.active_requests,
                request.context_tokens,
            )
        )
        return router_pb2.ReportReply()

    @typed_handler
    def Stats(self, request: router_pb2.StatsRequest, context: grpc.ServicerContext) -> router_pb2.StatsReply:
        return router_pb2.StatsReply(**self.core.stats())  # type: ignore[arg-type]


def http_app(core: RouterCore, metrics: ServiceMetrics, http_metrics: HttpMetrics, limits: HttpLimits) -> Starlette:
    """The router's HTTP endpoint (module docstring) as a Starlette app."""
    worker = Worker(limits)

    def error(err: KVPoolError) -> Response:
        status = http_status(err, _HTTP_STATUS.get(err.code, 500))
        return json_reply(status, {"error": err.code.wire_name, "message": err.message, "hint": err.hint})

    def timed(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            started = time.perf_counter()
            try:
                reply = await endpoint(request)
            except KVPoolError as err:
                reply = error(err)
            except (ValueError, TypeError) as exc:
                reply = error(InvalidArgument(f"bad request: {exc}"))
            http_metrics.observe(request.url.path, reply.status_code, time.perf_counter() - started)
            return reply

        return run

    def route(body: dict[str, Any]) -> dict[str, Any]:
        hashes = [bytes.fromhex(h) for h in body.get("hashes", [])] or None
        slo_obj = body.get("slo") or {}
        slo = _slo(core, float(slo_obj.get("ttft_ms", 0)), float(slo_obj.get("tpot_ms", 0)))
        req = core.request_from(
            body.get("token_ids") or None,
            hashes,
            int(body.get("input_tokens", 0)),
            int(body.get("output_tokens", 0)),
            slo,
            int(body.get("request_id", 0)),
        )
        return result_to_dict(core.route(req))

    async def post_route(request: Request) -> Response:
        body = await read_json(request, limits)
        return json_reply(200, await worker.run(lambda: route(body)))

    async def post_report(request: Request) -> Response:
        body = await read_json(request, limits)
        fields = {k: body[k] for k in WorkerLoad.__dataclass_fields__ if k in body}
        await worker.run(lambda: core.report(WorkerLoad(**fields)))
        return json_reply(200, {})

    async def get_stats(request: Request) -> Response:
        return json_reply(200, await worker.run(core.stats))

    async def get_metrics(request: Request) -> Response:
        body, content_type = await worker.run(lambda: exposition(metrics.registry))
        return Response(body, media_type=content_type)

    async def no_route(request: Request) -> Response:
        hint = "GET /stats or GET /metrics" if request.method == "GET" else "POST /route or /report"
        raise NotFound(f"no route {request.method} {request.url.path}", hint=hint)

    routes = [
        Route("/route", timed(post_route), methods=["POST"]),
        Route("/report", timed(post_report), methods=["POST"]),
        Route("/stats", timed(get_stats), methods=["GET"]),
        Route("/metrics", timed(get_metrics), methods=["GET"]),
        Route("/{path:path}", timed(no_route), methods=["GET", "POST"]),
    ]
    return Starlette(routes=routes)


class RouterServer:
    """gRPC + HTTP over one core. The constructor binds (port 0 = pick a free one);
    ``start`` serves, ``stop`` stops both and joins the HTTP server's thread."""

    def __init__(
        self,
        core: RouterCore,
        grpc_listen: str = "127.0.0.1:7460",
        http_listen: str | None = None,
        workers: int = 8,
        http_limits: HttpLimits = ROUTER_HTTP_LIMITS,
    ) -> None:
        self.core = core
        self.metrics = ServiceMetrics(RouterCollector(core.stats), "router")
        self._http_metrics = HttpMetrics(self.metrics.registry)
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvpool-router-rpc"),
            options=server_options(4 << 20),
            interceptors=self.metrics.interceptors(True),  # /metrics is always on its HTTP listener
        )
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(core), self._grpc)
        host, _, _port = grpc_listen.rpartition(":")
        self.grpc_port = self._grpc.add_insecure_port(grpc_listen)
        if self.grpc_port == 0:
            raise InvalidArgument(f"cannot bind gRPC to {grpc_listen}", hint="is the port in use?")
        self.grpc_address = f"{host}:{self.grpc_port}"
        self._http: HttpServer | None = None
        self.http_address = ""
        if http_listen:
            app = http_app(core, self.metrics, self._http_metrics, http_limits)
            self._http = HttpServer(app, http_listen, http_limits, "router")
            self.http_address = self._http.address

    def start(self) -> None:
        self._grpc.start()
        if self._http is not None:
            self._http.start()

    def stop(self) -> None:
        if self._http is not None:
            self._http.stop()
        self._grpc.stop(grace=1.0).wait()


__all__ = ["ROUTER_HTTP_LIMITS", "RouterServer", "RouterServicer", "http_app", "result_to_dict"]
