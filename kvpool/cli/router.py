"""Run the cache-aware router daemon.

Given a request's token ids (or block hashes), expected output length and SLOs, it
returns the prefill target (a prefill instance, the decode node itself, or the remote
prefill cluster), the decode instance, the expected prefix hit and TTFT -- or a
rejection when no placement meets the SLOs. It learns load from worker reports
(Report RPC / POST /report) and block locations from a pool daemon's KV events
(--pool; resyncs from a snapshot on a sequence gap). gRPC on --listen, HTTP/JSON on
--http-listen, both on 127.0.0.1 by default. Stop with SIGTERM or Ctrl-C.

Instances are named prefill-0.., decode-0.., remote-0..; a pool node whose id equals
one of these names is that instance's cache, any other node is the global pool.

HTTP/JSON (--http-listen):
  POST /route   {"token_ids": [...]}  (needs --spec)  or  {"hashes": ["32 hex digits", ...],
                "input_tokens": N}, plus "output_tokens": M, "slo": {"ttft_ms": .., "tpot_ms": ..},
                "request_id": K (all but the prompt optional)
             -> {"rejected", "reason", "prefill_kind" (instance | decode_local | remote; "" if
                 rejected), "prefill_instance", "decode_instance", "expected_hit_blocks", "expected_hit_tokens",
                 "expected_ttft_ms", "expected_tpot_ms", "decision_us"}
  POST /report  {"instance": "prefill-0", "queue_ms", "outstanding_requests",
                 "outstanding_tokens", "active_requests", "context_tokens"}   -> {}
  GET  /stats   counters;  GET /metrics  Prometheus (docs/metrics.md)
  errors: {"error": CODE, "message", "hint"} with a 4xx / 5xx status.

example:
  kvpool router --pool 127.0.0.1:7450 --prefill 4 --decode 2 --http-listen 127.0.0.1:7461
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:7460", help="gRPC address (default: %(default)s)")
    parser.add_argument("--http-listen", default="127.0.0.1:7461", help="HTTP/JSON address; '' = none")
    parser.add_argument("--policy", default="kv-centric", help="routing policy (default: %(default)s)")
    parser.add_argument("--prefill", type=int, default=4, help="prefill instances")
    parser.add_argument("--decode", type=int, default=2, help="decode instances")
    parser.add_argument("--remote-prefill", type=int, default=0, help="remote prefill instances")
    parser.add_argument("--cost-model", default="llama3-70b-a800x8", help="preset or fitted JSON file")
    parser.add_argument("--ttft-slo-ms", type=float, default=10_000.0, help="default TTFT SLO")
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0, help="default TPOT SLO")
    parser.add_argument("--pool", default="", help="pool daemon address to follow KV events from")
    parser.add_argument(
        "--spec", default="", help="KVSpec as JSON (or @file.json) of the namespace to hash tokens in and follow"
    )
    parser.add_argument("--salt", default="", help="tenant salt of that namespace (utf-8)")
    parser.add_argument(
        "--token", default=None, help="the tenant's token for a pool with credentials (env KVPOOL_TOKEN)"
    )
    parser.add_argument(
        "--tls-ca", default=None, metavar="FILE", help="PEM CA of a --pool that serves TLS (env KVPOOL_TLS_CA)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the policies' random choices (default 0)")
    from kvpool.cli.router_openai import add_openai_arguments

    add_openai_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import logging

    from kvpool.cli.inspect import root_certs_of, token_of
    from kvpool.cli.router_openai import openai_policy, start_openai
    from kvpool.core.clock import MonotonicClock
    from kvpool.core.errors import KVPoolError
    from kvpool.core.spec import KVSpec, Namespace
    from kvpool.core.supervisor import Supervisor
    from kvpool.scheduler.cluster import ClusterSpec, Slo
    from kvpool.scheduler.cost_model import load_cost_model
    from kvpool.scheduler.policies import make_policy
    from kvpool.scheduler.router_core import RouterCore
    from kvpool.scheduler.router_events import EventFollower, PoolSource
    from kvpool.scheduler.router_server import RouterServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec = None
        if args.spec:
            text = pathlib.Path(args.spec[1:]).read_text() if args.spec.startswith("@") else args.spec
            spec = KVSpec.from_dict(json.loads(text))
        namespace = Namespace(spec, args.salt.encode()) if spec is not None else None
        cluster = ClusterSpec(
            num_prefill=args.prefill,
            num_decode=args.decode,
            num_remote_prefill=args.remote_prefill,
            block_tokens=spec.block_tokens if spec is not None else 512,
        )
        core = RouterCore(
            cluster,
            load_cost_model(args.cost_model),
            openai_policy(args) or make_policy(args.policy, args.seed),
            MonotonicClock(),
            namespace,
            Slo(args.ttft_slo_ms, args.tpot_slo_ms),
        )
        server = RouterServer(core, args.listen, args.http_listen or None)
        follower = None
        token, root_certs = token_of(args), root_certs_of(args, "tls_ca")
        if args.pool:
            if spec is None:
                print("kvpool router: --pool needs --spec (the namespace to follow)", file=sys.stderr)
                return 2
            follower = EventFollower(lambda: PoolSource(args.pool, spec, args.salt.encode(), token, root_certs), core)
    except (KVPoolError, OSError, ValueError) as exc:
        print(f"kvpool router: {exc}", file=sys.stderr)
        return 2
    supervisor = Supervisor()  # owns the event follower's thread; SIGTERM/SIGINT stop it
    supervisor.install_stop_signals()
    server.start()
    if follower is not None:
        supervisor.spawn("router-events", follower.run)
    try:
        front = start_openai(args, core)
    except KVPoolError as exc:
        print(f"kvpool router: {exc}", file=sys.stderr)
        if follower is not None:
            follower.stop()
        supervisor.stop()
        server.stop()
        return 2
    print(
        f"kvpool router: grpc {server.grpc_address}"
        + (f", http {server.http_address}" if server.http_address else "")
        + (f", openai http://{front.address}/v1" if front else ""),
        flush=True,
    )
    failed = supervisor.wait_for_stop()
    if front is not None:
        front.stop()
    if follower is not None:
        follower.stop()  # ends its stream: run() returns and the supervisor joins it
    supervisor.stop()
    server.stop()
    if failed:
        return 1
    return 0
