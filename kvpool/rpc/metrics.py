"""Prometheus plumbing shared by the daemon, the directory and the router: a gRPC server
interceptor that times every unary call, and a small HTTP server for ``GET /metrics``.

Why an interceptor and a scrape-time collector rather than counters sprinkled through the
handlers: the daemons already keep exact counters (``kvpool.daemon.counters``, the stores'
stats, the directory's counters); the exporters read those when Prometheus scrapes, so there
is one set of numbers and ``/metrics`` can never disagree with ``kvpool inspect stats``. Only
what nothing else measures (call latency, calls in flight) is recorded here.

Every registry is the caller's own ``CollectorRegistry`` (no process-global state: two
daemons in one test process export separately). Label values are bounded: ``method`` is one
of the service's methods (gRPC answers an unknown method before the interceptor's wrapper
runs), ``code`` one of the gRPC status codes.

The HTTP server binds where it is told (the composition roots default to 127.0.0.1 and
refuse other hosts without ``--insecure``: docs/metrics.md), answers ``GET /metrics`` in the
Prometheus text format and 404 to anything else, and runs its loop on a thread the caller's
``Supervisor`` owns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from kvpool.core.errors import Unavailable
from kvpool.rpc.listen import split_listen

log = logging.getLogger("kvpool.metrics")

#: latency buckets in seconds: control calls take 0.1-10 ms here, a cluster lookup up to ~100 ms
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


#: (metric name, key in the stats, help): a counter's name is given without its _total suffix
MetricRow = tuple[str, str, str]


def scalar_families(
    stats: Mapping[str, Any], counters: Iterable[MetricRow], gauges: Iterable[MetricRow]
) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """Unlabelled counters and gauges from a stats dict; a key that is missing or not a
    number is left out (absent, never a made-up 0)."""
    for rows, family in ((counters, CounterMetricFamily), (gauges, GaugeMetricFamily)):
        for name, key, text in rows:
            value = stats.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                yield family(name, text, value=float(value))


class RpcMetrics:
    """Latency histogram and in-flight gauge of one gRPC service, in ``registry``.

    ``kvpool_rpc_duration_seconds{service, method, code}``: wall time of each unary call, from
    the handler's start to its reply or error; ``kvpool_rpc_in_flight{service}``: calls being
    handled now (the depth of the server's work queue as the handlers see it)."""

    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self.service = service
        self.duration = Histogram(
            "kvpool_rpc_duration_seconds",
            "Wall time of a unary gRPC call in the handler, by service, method and status code.",
            ("service", "method", "code"),
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )
        self.in_flight = Gauge(
            "kvpool_rpc_in_flight", "gRPC calls being handled now, by service.", ("service",), registry=registry
        )
        self.in_flight.labels(service)  # the series exists (at 0) before the first call
        self._children: dict[tuple[str, str, str], Any] = {}  # (service, method, code) -> child (bounded labels)

    def interceptor(self) -> grpc.ServerInterceptor:
        return _TimingInterceptor(self)

    def timed(
        self, method: str, inner: Callable[[Any, grpc.ServicerContext], Any], service: str = ""
    ) -> Callable[..., Any]:
        """``inner`` wrapped so that each call is observed under ``method`` (and ``service``,
        default this one's: the daemon's same-host socket reports as ``pool-local``)."""
        service = service or self.service
        in_flight = self.in_flight.labels(service)

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            started = time.perf_counter()
            in_flight.inc()
            code = "OK"
            try:
                return inner(request, context)
            except BaseException:
                code = _status_name(context, default="UNKNOWN")
                raise
            finally:
                in_flight.dec()
                if code == "OK":
                    code = _status_name(context, default="OK")
                child = self._children.get((service, method, code))
                if child is None:
                    child = self._children[(service, method, code)] = self.duration.labels(service, method, code)
                child.observe(time.perf_counter() - started)

        return call


def _status_name(context: grpc.ServicerContext, default: str) -> str:
    """The status the handler set (abort or set_code), else ``default``."""
    try:
        code = context.code()  # type: ignore[attr-defined]
    except (AttributeError, NotImplementedError):
        return default
    if isinstance(code, grpc.StatusCode):
        return code.name
    return default


class _TimingInterceptor(grpc.ServerInterceptor):
    def __init__(self, metrics: RpcMetrics) -> None:
        self._metrics = metrics

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler  # unknown method (bounded labels) or a stream (Events: not a latency)
        method = str(handler_call_details.method).rsplit("/", 1)[-1]
        return grpc.unary_unary_rpc_method_handler(
            self._metrics.timed(method, handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


SCRAPE_TIMEOUT_S = 10.0


class MetricsServer:
    """``GET /metrics`` over ``registry`` on ``listen`` (port 0 = a free one). ``serve`` is the
    loop, meant for ``Supervisor.spawn``; ``stop`` ends it and closes the socket.

    One thread, the supervisor's: scrapes are answered one at a time on it (a scrape is one
    short request every few seconds), so no thread per request exists to be left running,
    and a client that stalls is cut off after ``SCRAPE_TIMEOUT_S``."""

    def __init__(self, listen: str, registry: CollectorRegistry) -> None:
        host, port = split_listen(listen, "metrics address")
        try:
            self._http = HTTPServer((host, port), _handler_for(registry))
        except OSError as exc:
            raise Unavailable(
                f"cannot serve metrics on {listen}: {exc.strerror or exc}",
                hint="pick a free port with --metrics-listen 127.0.0.1:PORT, or leave it empty to turn metrics off",
            ) from None
        self.address = f"{host}:{self._http.server_address[1]}"
        self._stopped = threading.Event()

    def serve(self) -> None:
        self._http.serve_forever(poll_interval=0.5)

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._http.shutdown()
        self._http.server_close()


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """(body, content type) of one scrape of ``registry``."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def _handler_for(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "kvpool-metrics/1"
        timeout = SCRAPE_TIMEOUT_S  # the socket's: a stalled client cannot hold the one thread

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("metrics http: " + format, *args)

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only GET /metrics here")
                return
            body, content_type = exposition(registry)
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


class ServiceMetrics:
    """One daemon's metrics: its own ``registry`` with ``collector`` (the daemon's counters,
    read at scrape time) and the call latency of its gRPC ``service``. ``serve`` starts
    ``GET /metrics`` on ``listen`` with ``spawn`` (a ``Supervisor.spawn``); "" = no HTTP
    listener (then install no interceptor either: ``interceptors(False)``)."""

    def __init__(self, collector: Collector, service: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.rpc = RpcMetrics(self.registry, service)
        self.server: MetricsServer | None = None

    def interceptors(self, enabled: bool) -> list[grpc.ServerInterceptor]:
        """The gRPC interceptors to install: the timing one when metrics are served (a daemon
        without a metrics listener pays nothing per call)."""
        return [self.rpc.interceptor()] if enabled else []

    def serve(self, listen: str, spawn: Callable[[str, Callable[[], None]], None]) -> None:
        if listen:
            self.server = MetricsServer(listen, self.registry)
            spawn("metrics-http", self.server.serve)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
