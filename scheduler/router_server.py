"""The router daemon's transports: gRPC (``kvpool.router.v1.Router``) and a small
HTTP/JSON endpoint, both over one ``RouterCore``, both bound to loopback by default.

HTTP (stdlib ``http.server``, threaded):
  POST /route   {"token_ids": [...]} or {"hashes": ["hex", ...], "input_tokens": n},
                "output_tokens": m, "slo": {"ttft_ms": .., "tpot_ms": ..}   -> decision
  POST /report  {"instance": "prefill-0", "queue_ms": .., ...}               -> {}
  GET  /stats                                                                 -> counters
  GET  /metrics                                     -> Prometheus text format (docs/metrics.md)
Errors come back as {"error": CODE, "message", "hint"} with a 4xx/5xx status.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc

from kvpool.core.errors import ErrorCode, InvalidArgument, KVPoolError, NotFound
from kvpool.core.hashing import unpack_hashes
from kvpool.proto import router_pb2, router_pb2_grpc
from kvpool.rpc.codec import server_options
from kvpool.rpc.errors import typed_handler
from kvpool.rpc.http_json import read_json_body
from kvpool.rpc.metrics import ServiceMetrics, exposition
from kvpool.scheduler.cluster import Slo
from kvpool.scheduler.router_core import RouterCore, RouteResult, WorkerLoad
from kvpool.scheduler.router_metrics import HttpMetrics, RouterCollector

log = logging.getLogger(__name__)

_HTTP_STATUS = {ErrorCode.INVALID_ARGUMENT: 400, ErrorCode.NOT_FOUND: 404, ErrorCode.UNAVAILABLE: 503}


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


def _handler_for(core: RouterCore, metrics: ServiceMetrics, http_metrics: HttpMetrics) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "kvpool-router/1"
        _started = 0.0

        def send_response(self, code: int, message: str | None = None) -> None:
            super().send_response(code, message)
            http_metrics.observe(getattr(self, "path", ""), code, time.perf_counter() - self._started)

        def parse_request(self) -> bool:
            self._started = time.perf_counter()
            return super().parse_request()

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http: " + format, *args)

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, err: KVPoolError) -> None:
            self._send(
                _HTTP_STATUS.get(err.code, 500), {"error": err.code.wire_name, "message": err.message, "hint": err.hint}
            )

        def _body(self) -> dict[str, Any]:
            return read_json_body(self, 64 << 20)

        def do_GET(self) -> None:
            if self.path == "/stats":
                self._send(200, core.stats())
            elif self.path == "/metrics":
                body, content_type = exposition(metrics.registry)
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self._error(NotFound(f"no route GET {self.path}", hint="GET /stats or GET /metrics"))

        def do_POST(self) -> None:
            try:
                body = self._body()
                if self.path == "/route":
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
                    self._send(200, result_to_dict(core.route(req)))
                elif self.path == "/report":
                    fields = {k: body[k] for k in WorkerLoad.__dataclass_fields__ if k in body}
                    core.report(WorkerLoad(**fields))
                    self._send(200, {})
                else:
                    raise NotFound(f"no route POST {self.path}", hint="POST /route or /report")
            except KVPoolError as err:
                self._error(err)
            except (ValueError, TypeError) as exc:
                self._error(InvalidArgument(f"bad request: {exc}"))

    return Handler


class RouterServer:
    """gRPC + HTTP over one core. ``start`` binds (port 0 = pick a free one)."""

    def __init__(
        self, core: RouterCore, grpc_listen: str = "127.0.0.1:7460", http_listen: str | None = None, workers: int = 8
    ) -> None:
        self.core = core
        self.metrics = ServiceMetrics(RouterCollector(core.stats), "router")
        self._http_metrics = HttpMetrics(self.metrics.registry)
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers),
            options=server_options(4 << 20),
            interceptors=self.metrics.interceptors(True),  # /metrics is always on its HTTP listener
        )
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(core), self._grpc)
        host, _, _port = grpc_listen.rpartition(":")
        self.grpc_port = self._grpc.add_insecure_port(grpc_listen)
        if self.grpc_port == 0:
            raise InvalidArgument(f"cannot bind gRPC to {grpc_listen}", hint="is the port in use?")
        self.grpc_address = f"{host}:{self.grpc_port}"
        self._http: ThreadingHTTPServer | None = None
        self.http_address = ""
        if http_listen:
            h_host, _, h_port = http_listen.rpartition(":")
            self._http = ThreadingHTTPServer(
                (h_host, int(h_port)), _handler_for(core, self.metrics, self._http_metrics)
            )
            self.http_address = f"{h_host}:{self._http.server_address[1]}"
        self._http_thread: threading.Thread | None = None

    def start(self) -> None:
        self._grpc.start()
        if self._http is not None:
            self._http_thread = threading.Thread(target=self._http.serve_forever, name="router-http", daemon=True)
            self._http_thread.start()

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self._grpc.stop(grace=1.0).wait()


__all__ = ["RouterServer", "RouterServicer", "result_to_dict"]
