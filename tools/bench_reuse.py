"""Prefix reuse benchmark: TTFT with 0/50/90 % of the prompt in the pool vs cold, and kernel GB/s.

    .venv/bin/python tools/bench_reuse.py                 # starts its own daemon on loopback
    .venv/bin/python tools/bench_reuse.py --pool HOST:PORT --lengths 2048 4096
    .venv/bin/python tools/bench_reuse.py --kernels-only --threads 1

Part 1 runs the reference engine (kvpool.engine) on this CPU. For each prompt length it
measures the cold TTFT (engine without a pool), then, with a real daemon and PoolClient, the
TTFT of prompts whose first 0 %, 50 % and 90 % of tokens were stored by an earlier request.
Every ratio is against the cold TTFT of the same length in the same run.

Part 2 times gather (paged cache -> canonical blocks) and scatter (back) against a plain
contiguous copy of the same bytes, in the same run, for the previous CPU default ("before":
strategy="direct", one thread) and the current one ("auto"), with a random and a consecutive
page table. Only part 2: ``--kernels-only`` (same as ``--skip-ttft``).

Targets (issue 5): 90 % cached TTFT <= 0.2x cold; gather/scatter >= 0.5x plain copy.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvpool.engine.engine import Engine, EngineConfig, SamplingParams
from kvpool.engine.model import ModelConfig

REPO = Path(__file__).resolve().parents[1]


def start_daemon(capacity_bytes: int, *extra: str) -> tuple[subprocess.Popen[bytes], str, str]:
    """A ``kvpool serve`` of ``capacity_bytes`` on a free loopback port, arena in a fresh
    folder, with ``extra`` options; (process, address, arena folder) once it listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    arena = tempfile.mkdtemp(prefix="kvpool-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    cmd = [sys.executable, "-m", "kvpool.cli.main", "serve", "--listen", address]
    cmd += ["--capacity-bytes", str(capacity_bytes), "--arena-dir", arena, *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                time.sleep(0.5)
                return proc, address, arena
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"daemon exited with {proc.returncode}") from None
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("daemon did not start")


def ttft(engine: Engine, prompt: list[int], rid: str) -> tuple[float, int, int]:
    req = engine.add_request(rid, prompt, SamplingParams(max_new_tokens=1))
    engine.run_until_done()
    assert req.ttft_s is not None
    return req.ttft_s, req.hit_tokens, req.prefill_tokens_run


def bench_ttft(address: str, lengths: list[int], repeats: int, codec: str = "", local_calls: bool = True) -> None:
    """Each cached query is paired with a cold run of the same length just before it; the
    reported ratio is the median over repeats of (cached TTFT / its paired cold TTFT), so a
    burst of load from other processes on this shared machine hits both sides alike."""
    from kvpool.client import PoolClient

    model_config = ModelConfig()
    config = EngineConfig(num_pages=max(lengths) // 16 + 64, page_tokens=16, block_tokens=32)
    gen = torch.Generator().manual_seed(0)
    spec = model_config.kv_spec(config.block_tokens)
    fracs = (0.0, 0.5, 0.9)
    wire_spec = spec
    if codec:  # blocks go through the pool int8/fp8-compressed (kvpool.connectors.compressed_pool)
        from kvpool.connectors.compressed_pool import compressed_spec

        wire_spec = compressed_spec(spec, codec)
        print(f"pool blocks compressed with {codec}: {wire_spec.block_bytes} bytes instead of {spec.block_bytes}")
    with PoolClient.connect(address, wire_spec, salt=b"bench", local_calls=local_calls) as client:
        print(f"control calls over {'the same-host socket' if client._local is not None else 'gRPC'}")
        cold_engine = Engine(model_config, config)
        pool: Any = client
        if codec:
            from kvpool.connectors.compressed_pool import CompressedPool

            pool = CompressedPool(client, spec, codec)
        pool_engine = Engine(model_config, config, pool)
        print(f"model: {model_config}; best TTFT of {repeats}, ratio = median of paired ratios")
        print(f"{'tokens':>7} {'cached':>7} {'hit':>6} {'ran':>6} {'ttft_ms':>9} {'cold_ms':>9} {'ratio':>6}")
        for n in lengths:
            colds: list[float] = []
            runs: dict[float, list[tuple[float, int, int]]] = {f: [] for f in fracs}
            ratios: dict[float, list[float]] = {f: [] for f in fracs}
            for r in range(repeats):
                for frac in fracs:
                    cold = ttft(cold_engine, torch.randint(0, 1024, (n,), generator=gen).tolist(), "c")[0]
                    base = torch.randint(0, 1024, (n,), generator=gen).tolist()
                    ttft(pool_engine, base, f"store-{n}-{frac}-{r}")  # puts the base prompt's blocks
                    shared = int(n * frac)
                    prompt = base[:shared] + torch.randint(0, 1024, (n - shared,), generator=gen).tolist()
                    run = ttft(pool_engine, prompt, f"q-{n}-{frac}-{r}")
                    colds.append(cold)
                    runs[frac].append(run)
                    ratios[frac].append(run[0] / cold)
            best_cold = min(colds)
            print(f"{n:>7} {'cold':>7} {0:>6} {n:>6} {best_cold * 1e3:>9.1f} {best_cold * 1e3:>9.1f} {1.0:>6.2f}")
            for frac in fracs:
                t, hit, ran = min(runs[frac])
                ratio = statistics.median(ratios[frac])
                print(
                    f"{n:>7} {f'{frac:.0%}':>7} {hit:>6} {ran:>6} {t * 1e3:>9.1f} {best_cold * 1e3:>9.1f} {ratio:>6.3f}"
                )


def bench_kernels(tokens: int, repeats: int) -> None:
    """gather/scatter vs a plain ``copy_`` of the same bytes, interleaved, best of ``repeats``.

    "before" is the previous CPU default (strategy="direct", one thread: strided
    ``index_select`` per layer and page slot; numpy row assignment for scatter), kept as a
    strategy so every run measures old and new side by side. "auto" is what callers get now.
    Two page tables: random (pages scattered: the worst case) and consecutive (pages
    ``i, i+1, ...`` as a fresh allocator hands them out).
    """
    from kvpool.core.spec import KVSpec
    from kvpool.kernels.paged import PagedLayout, gather_blocks, scatter_blocks

    spec = KVSpec("llama-3-8b-like", 32, 8, 128, "bfloat16", 64)
    nb = tokens // spec.block_tokens
    print(f"\nkernels: {spec.describe()}, {nb} blocks = {nb * spec.block_bytes / 2**20:.0f} MiB, page 16,")
    print(f"  torch threads {torch.get_num_threads()}, best of {repeats}, ratio = plain copy time / kernel time")
    before: dict[str, Any] = {"strategy": "direct", "workers": 1}
    for order in ("NHD", "HND"):
        layout = PagedLayout(16, 8, 128, order)
        pages = nb * 4 + 64
        caches = [torch.randn(layout.page_shape(2, pages)).to(torch.bfloat16) for _ in range(spec.num_layers)]
        blocks = torch.empty(nb, *spec.block_shape, dtype=torch.bfloat16)
        src, dst = torch.randn_like(blocks), torch.empty_like(blocks)
        tables = {"random": torch.randperm(pages)[: nb * 4], "consecutive": torch.arange(7, 7 + nb * 4)}
        for kind, table in tables.items():
            fns: dict[str, Callable[[], object]] = {  # partial: binds this loop's tensors now
                "plain": partial(dst.copy_, src),
                "gather before": partial(gather_blocks, spec, layout, caches, table, blocks, nb, **before),
                "gather auto": partial(gather_blocks, spec, layout, caches, table, blocks, nb),
                "scatter before": partial(scatter_blocks, spec, layout, blocks, caches, table, nb, **before),
                "scatter auto": partial(scatter_blocks, spec, layout, blocks, caches, table, nb),
            }
            times = {k: float("inf") for k in fns}
            for _ in range(repeats):  # interleaved, best of each: load bursts hit all of them alike
                for name, fn in fns.items():
                    t = time.perf_counter()
                    fn()
                    times[name] = min(times[name], time.perf_counter() - t)
            nbytes = blocks.numel() * 2
            plain = times["plain"]
            line = f"  {order} {kind:>11}: plain {nbytes / plain / 1e9:5.2f} GB/s"
            for name in list(fns)[1:]:
                line += f" | {name} {nbytes / times[name] / 1e9:5.2f} GB/s {plain / times[name]:.2f}x"
            print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", default="", help="an existing daemon; default: start one")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernel-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-ttft", "--kernels-only", action="store_true", help="run only the kernel part")
    parser.add_argument("--codec", choices=["", "int8", "fp8"], default="", help="compress pool blocks")
    parser.add_argument(
        "--grpc", action="store_true", help="control calls over gRPC, not the daemon's same-host socket"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop our daemon
    proc, arena = None, ""
    address = args.pool
    if not args.skip_ttft:
        if not address:
            proc, address, arena = start_daemon(1 << 30)
        try:
            bench_ttft(address, args.lengths, args.repeats, args.codec, local_calls=not args.grpc)
        finally:
            if proc is not None:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(10)
                shutil.rmtree(arena, ignore_errors=True)
    bench_kernels(args.kernel_tokens, 5 * args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
