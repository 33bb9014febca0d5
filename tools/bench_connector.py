"""The vLLM connector's data path: save / load GB/s in place vs through a staging buffer.

    .venv/bin/python tools/bench_connector.py                  # Llama-3-8B-shaped blocks (2 MiB)
    .venv/bin/python tools/bench_connector.py --shape bench --rounds 7

Runs ``VllmPoolConnectorLogic`` (the worker side of ``KvpoolConnector``, without vLLM) on
vLLM-shaped caches (``[B, H, N, 2 * D]`` per layer, the CPU backend's packing, random page
ids as vLLM's allocator hands them out) against a real daemon through ``PoolClient``:

* ``in place`` (this code): ``wait_for_save`` gathers the pages straight into the put's
  arena slots and checksums them there, the saver thread commits; ``start_load_kv``
  verifies the leased bytes run by run and scatters them straight into the pages;
* ``staged`` (the code before, kept as the fallback for pools without slots): the same
  connector over a pool that exposes only ``put`` / ``get_into``: gather into a private
  buffer, then ``put`` copies it into the arena; ``get_into`` copies into a buffer, then the
  scatter.

Both are timed in the same run, interleaved (ABAB...), against two baselines measured in
each round on the same bytes: a plain ``copy_`` between two private buffers, and the
kernel's gather alone into a private buffer (the engine-side floor of a save). Figures:
``save step`` (``wait_for_save``: what the engine step waits for), ``save`` (until the
commit is done), ``load`` (``start_load_kv``), each in GB/s of KV moved, medians over the
rounds with min-max. The figures are for the machine the bench runs on; a loaded machine
(other jobs on the cores) lowers every row, the interleaving keeps the ratios comparable.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from bench_reuse import start_daemon  # tools/ is on sys.path when a tool runs as a script

from kvpool.client import PoolClient
from kvpool.connectors.vllm import BlockTransfer, ConnectorMetadata, VllmPoolConnectorLogic
from kvpool.core.spec import KVSpec
from kvpool.kernels.paged import gather_blocks

#: name -> (layers, kv heads, head_dim, dtype, block tokens); vLLM's block = the pool block
SHAPES: dict[str, tuple[int, int, int, str, int]] = {
    "llama8b": (32, 8, 128, "bfloat16", 16),  # 2 MiB per block
    "bench": (4, 2, 64, "float32", 128),  # tools/bench_vllm.py's model: 512 KiB per block
    "small": (2, 2, 64, "float16", 16),  # 16 KiB per block
}


class CopyingPool:
    """Only ``BlockPool``'s four methods of a client: the connector takes its staging path."""

    def __init__(self, client: PoolClient) -> None:
        self._client = client
        self.spec = client.spec

    def hashes(self, token_ids: Any) -> list[bytes]:
        return self._client.hashes(token_ids)

    def lookup(self, hashes: Sequence[bytes]) -> int:
        return self._client.lookup(hashes)

    def put(self, hashes: Sequence[bytes], blocks: Any) -> Any:
        return self._client.put(hashes, blocks)

    def get_into(self, hashes: Sequence[bytes], out: Any) -> int:
        return self._client.get_into(hashes, out)


def vllm_caches(spec: KVSpec, pages: int, seed: int) -> dict[str, torch.Tensor]:
    """One ``[B, H, N, 2 * D]`` tensor per layer, as vLLM's CPU backend registers them."""
    gen = torch.Generator().manual_seed(seed)
    shape = (pages, spec.num_kv_heads, spec.block_tokens, 2 * spec.head_dim)
    dtype = getattr(torch, spec.dtype)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(*shape, generator=gen).to(dtype) for i in range(spec.num_layers)
    }


def timed(work: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    work()
    return time.perf_counter() - t0


def one_round(
    logic: VllmPoolConnectorLogic, client: PoolClient, spec: KVSpec, blocks: int, page_ids: list[int], tag: str
) -> dict[str, float]:
    """Save ``blocks`` blocks of fresh hashes, load them back, remove them; seconds of each part."""
    hashes = client.hashes(list(range(hash(tag) % 10_000_000, hash(tag) % 10_000_000 + blocks * spec.block_tokens)))
    move = BlockTransfer(tag, tuple(hashes), tuple(page_ids))
    t0 = time.perf_counter()
    logic.wait_for_save(ConnectorMetadata(saves=[move]))
    step_s = time.perf_counter() - t0
    if not logic.drain_saves(120.0):
        raise SystemExit("saves did not drain")
    save_s = time.perf_counter() - t0
    if client.lookup(hashes) != blocks:
        raise SystemExit(f"{tag}: the saved blocks are not all in the pool")
    load_s = timed(lambda: logic.start_load_kv(ConnectorMetadata(loads=[move])))
    if logic.get_block_ids_with_load_errors():
        raise SystemExit(f"{tag}: load errors")
    client.remove(hashes)
    client.flush_releases()
    return {"save_step": step_s, "save": save_s, "load": load_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    parser.add_argument("--blocks", type=int, default=0, help="blocks per save (default: 64 MiB of them)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the kernels' workers)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers, heads, dim, dtype, tokens = SHAPES[args.shape]
    spec = KVSpec(f"bench-{args.shape}", layers, heads, dim, dtype, tokens)
    blocks = args.blocks or max(1, (64 << 20) // spec.block_bytes)
    nbytes = blocks * spec.block_bytes
    print(f"{args.shape}: {spec.block_bytes // 1024} KiB blocks, {blocks} per save ({nbytes >> 20} MiB), "
          f"{args.rounds} rounds, torch threads {args.threads}")  # fmt: skip
    proc, address, arena_dir = start_daemon(max(256 << 20, 4 * nbytes))
    try:
        pages = 2 * blocks
        kv = vllm_caches(spec, pages, seed=1)
        page_ids = torch.randperm(pages, generator=torch.Generator().manual_seed(2))[:blocks].tolist()
        with PoolClient.connect(address, spec) as client:
            paths: dict[str, VllmPoolConnectorLogic] = {}
            for name, pool in (("in place", client), ("staged", CopyingPool(client))):
                logic = VllmPoolConnectorLogic(spec, pool, tokens, max_pending_save_bytes=2 * nbytes)
                logic.register_kv_caches(kv, "CPU_ATTN")
                paths[name] = logic
            views, paged = paths["in place"]._views, paths["in place"]._paged
            assert paged is not None
            src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
            dst = torch.empty(nbytes, dtype=torch.uint8).fill_(2)
            out = torch.empty(blocks, *spec.block_shape, dtype=getattr(torch, dtype)).fill_(0)
            figures: dict[str, list[float]] = {}
            for r in range(-1, args.rounds):  # round -1 warms every path up and is not counted
                parts: dict[str, float] = {
                    "plain copy": timed(lambda: dst.copy_(src)),
                    "gather alone": timed(lambda: gather_blocks(spec, paged, views, page_ids, out, blocks)),
                }
                order = ("in place", "staged") if r % 2 == 0 else ("staged", "in place")
                for name in order:
                    for part, seconds in one_round(paths[name], client, spec, blocks, page_ids, f"{name}-{r}").items():
                        parts[f"{name}: {part}"] = seconds
                if r >= 0:
                    for key, seconds in parts.items():
                        figures.setdefault(key, []).append(nbytes / seconds / 1e9)
            for logic in paths.values():
                logic.shutdown()
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(arena_dir, ignore_errors=True)
    copy = statistics.median(figures["plain copy"])
    print(f"{'GB/s (median, min-max)':<28} {'':>22} {'x plain copy':>13}")
    for key, values in figures.items():
        med = statistics.median(values)
        print(f"{key:<28} {med:7.2f} ({min(values):5.2f}-{max(values):5.2f}) {med / copy:13.2f}")
    for part in ("save_step", "save", "load"):
        ratios = [a / b for a, b in zip(figures[f"in place: {part}"], figures[f"staged: {part}"], strict=True)]
        spread = f"(per round {min(ratios):.2f}-{max(ratios):.2f})"
        print(f"in place / staged, {part:<10} {statistics.median(ratios):5.2f}x {spread}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
