"""A prefill/decode-disaggregated cluster on this machine, with an OpenAI-compatible front door.

  kvpool demo                       pool + 1 prefill + 1 decode instance + router on 127.0.0.1:8000
  kvpool demo --engine ref          the reference engine instead of vLLM
  kvpool demo bench                 the serving modes side by side (docs/demo.md)

Then, from another shell:
  curl -N http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
       -d '{"prompt": "w1 w2 w3", "max_tokens": 8, "stream": true}'

For each request the router prefills on the decode instance (prompt short or mostly in the
pool already) or on a prefill instance, which writes the KV into the pool for the decode
instance to load (docs/demo.md: the handshake). Ctrl-C or SIGTERM stops every process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.cli.demo_stack import DemoConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpool.cli.demo_stack import ENGINE_KINDS, DemoConfig

    d = DemoConfig()
    parser.add_argument("action", nargs="?", choices=("up", "bench"), default="up", help="up (default) or bench")
    parser.add_argument(
        "--engine", choices=ENGINE_KINDS, default=d.engine, help="vllm | ref | auto (vLLM if installed)"
    )
    parser.add_argument("--prefill", type=int, default=d.num_prefill, help="prefill instances (default 1)")
    parser.add_argument("--decode", type=int, default=d.num_decode, help="decode instances (default 1)")
    parser.add_argument("--listen", default=d.listen, help=f"the front door (default {d.listen})")
    parser.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=d.local_prefill_tokens,
        help="prefill on the decode instance when at most this many prompt tokens are uncached",
    )
    parser.add_argument(
        "--busy-local-prefill-tokens",
        type=int,
        default=d.busy_local_prefill_tokens,
        help="the same limit while the decode instance is decoding (a local prefill stalls its decodes)",
    )
    parser.add_argument("--route", choices=("auto", "local", "remote"), default=d.route, help="force one path")
    parser.add_argument("--model", default="", help="vLLM model directory (default: a tiny random-weight Llama)")
    parser.add_argument("--capacity-bytes", default=d.capacity_bytes, help="pool capacity")
    parser.add_argument("--no-pin", action="store_true", help="do not pin engines to CPU cores")
    parser.add_argument("--workdir", default="", help="logs, the model, the spec (default: a new temp directory)")
    parser.add_argument("--json", action="store_true", help="print the addresses as one JSON line")
    from kvpool.cli.demo_bench import add_bench_arguments

    add_bench_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvpool.cli.demo_stack import DemoConfig
    from kvpool.core.errors import KVPoolError

    try:
        cfg = DemoConfig(
            engine=args.engine,
            num_prefill=args.prefill,
            num_decode=args.decode,
            listen=args.listen,
            local_prefill_tokens=args.local_prefill_tokens,
            busy_local_prefill_tokens=args.busy_local_prefill_tokens,
            route=args.route,
            capacity_bytes=args.capacity_bytes,
            model_dir=args.model,
            pin=not args.no_pin,
        )
    except KVPoolError as err:
        print(f"kvpool demo: {err}", file=sys.stderr)
        return 2
    workdir = args.workdir or tempfile.mkdtemp(prefix="kvpool-demo-")
    os.makedirs(workdir, exist_ok=True)
    if args.action == "bench":
        from kvpool.cli.demo_bench import run_bench

        return run_bench(args, cfg, workdir)
    return _up(args, cfg, workdir)


def _up(args: argparse.Namespace, cfg: DemoConfig, workdir: str) -> int:
    from kvpool.cli.demo_stack import start_stack
    from kvpool.daemon.launcher import LocalCluster
    from kvpool.daemon.supervise import run_foreground

    def start(cluster: LocalCluster) -> dict[str, object]:
        return start_stack(cluster, cfg).to_dict()

    def announce(info: dict[str, object]) -> None:
        if args.json:
            print(json.dumps(info), flush=True)
            return
        print(f"kvpool demo: {info['engine']} engines, OpenAI front door at {info['front_door']}", flush=True)
        engines = info["engines"]
        cpus = info["cpus"]
        assert isinstance(engines, dict) and isinstance(cpus, dict)
        for name, url in engines.items():
            pinned = ",".join(map(str, cpus.get(name) or [])) or "-"
            print(f"  {name:<10} {url:<24} cores {pinned}", flush=True)
        print(f"  pool       {info['pool']}\n  ({info['pinning_note']}; logs in {workdir})", flush=True)
        print(
            f"try: curl -N {info['front_door']}/completions -H 'content-type: application/json' "
            '-d \'{"prompt": "w1 w2 w3", "max_tokens": 8, "stream": true}\'\nCtrl-C to stop',
            file=sys.stderr,
            flush=True,
        )

    def survivable(name: str) -> bool:  # an engine: the router fails its requests, the rest serves on
        return name.startswith(("prefill-", "decode-"))

    cluster = LocalCluster(workdir, die_with_parent=True)
    return run_foreground(cluster, start, announce, os.path.join(workdir, "demo.json"), survivable=survivable)
