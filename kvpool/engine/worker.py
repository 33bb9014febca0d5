"""Run the reference engine as a prefill or decode worker process against a pool daemon.

    python -m kvpool.engine.worker --role prefill --pool 127.0.0.1:7450 --requests in.json --out out.json

``--requests`` is a JSON list of ``{"id", "prompt": [token ids], "max_new_tokens",
"temperature", "top_k", "seed"}``. A prefill worker stores each prompt's KV blocks in the pool
and writes the first token; a decode worker is given ``prompt + [first token]`` (what the
prefill worker produced), loads the cached prefix from the pool and decodes the rest. The
output is a JSON list of ``{"id", "output", "hit_tokens", "prefill_tokens_run", "ttft_s",
"load_errors"}``. This module is a composition root: it alone reads argv.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from kvpool.engine.engine import ROLES, Engine, EngineConfig, SamplingParams
from kvpool.engine.model import ModelConfig, RefModel


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool.engine.worker", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--role",
        choices=ROLES,
        required=True,
        help="prefill: store each prompt's KV in the pool and emit the first token; decode: load the cached "
        "prefix and decode the rest; both: one colocated engine",
    )
    parser.add_argument("--pool", default="", help="daemon HOST:PORT; empty = no pool")
    parser.add_argument("--salt", default="", help="tenant salt of the pool namespace")
    parser.add_argument("--requests", required=True, help="JSON file of requests")
    parser.add_argument("--out", required=True, help="JSON file to write results to")
    parser.add_argument("--seed", type=int, default=0, help="model weight seed")
    parser.add_argument(
        "--num-layers",
        type=int,
        default=ModelConfig.num_layers,
        help="layers of the reference model (default %(default)s)",
    )
    parser.add_argument("--dtype", default="float32", help="torch dtype of weights and KV (default %(default)s)")
    parser.add_argument(
        "--num-pages", type=int, default=2048, help="pages of the engine's own paged KV cache (default %(default)s)"
    )
    parser.add_argument("--page-tokens", type=int, default=16, help="tokens per engine KV page (default %(default)s)")
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=32,
        help="tokens per pool block, a multiple of --page-tokens; prefill and decode must agree (default %(default)s)",
    )
    parser.add_argument("--chunk-tokens", type=int, default=0, help="chunked prefill size in tokens; 0 = off (default)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default %(default)s)")
    return parser


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    model_config = ModelConfig(num_layers=args.num_layers, dtype=args.dtype, seed=args.seed)
    config = EngineConfig(
        num_pages=args.num_pages,
        page_tokens=args.page_tokens,
        block_tokens=args.block_tokens,
        chunk_tokens=args.chunk_tokens or None,
        role=args.role,
    )
    with open(args.requests) as fh:
        requests: list[dict[str, Any]] = json.load(fh)
    model = RefModel(model_config)  # built once: its weight fingerprint names the pool namespace
    client = None
    if args.pool:
        from kvpool.client import PoolClient

        client = PoolClient.connect(args.pool, model.kv_spec(args.block_tokens), salt=args.salt.encode())
    try:
        engine = Engine(model_config, config, client, model=model)
        handles = []
        for item in requests:
            params = SamplingParams(
                max_new_tokens=int(item.get("max_new_tokens", 16)),
                temperature=float(item.get("temperature", 0.0)),
                top_k=int(item.get("top_k", 0)),
                seed=int(item.get("seed", 0)),
            )
            handles.append(engine.add_request(str(item["id"]), [int(t) for t in item["prompt"]], params))
        engine.run_until_done()
        results = [
            {
                "id": r.request_id,
                "output": r.output,
                "hit_tokens": r.hit_tokens,
                "prefill_tokens_run": r.prefill_tokens_run,
                "ttft_s": r.ttft_s,
                "load_errors": engine.load_errors,
            }
            for r in handles
        ]
    finally:
        if client is not None:
            client.close()
    with open(args.out, "w") as fh:
        json.dump(results, fh)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
