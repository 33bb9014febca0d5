"""Gather an engine's paged KV cache into canonical pool blocks, and scatter them back.

Engines keep KV per layer in fixed-size pages (vLLM-style ``[kv, num_pages, page_tokens,
kv_heads, head_dim]``, "NHD", or ``[kv, num_pages, kv_heads, page_tokens, head_dim]``,
"HND"). The pool keeps one object per block in the canonical layout
``[layer][k|v][kv_head][token][head_dim]`` (``KVSpec.block_shape``), so that:

* engine page size and pool block size are independent: a pool block spans
  ``block_tokens // page_tokens`` pages, or one page holds ``page_tokens // block_tokens``
  pool blocks;
* a tensor-parallel rank that holds kv heads ``[head_start, head_start + heads)`` reads and
  writes only that head range of every layer of the same pool blocks (TP=2 writer, TP=4
  reader share keys and bytes).

The implementation is plain torch and numpy (numpy views of CPU tensors), so the same code
runs on CPU (the oracle) and on CUDA tensors. On this 2-core CPU a gather is bound by memory
access patterns, not arithmetic: a block is a transpose of page rows (NHD rows are only
``head_dim`` elements long), and a transposing copy that reads DRAM at a stride measured ~0.55x
a plain ``copy_`` even with no page table at all. The strategies, all tested against the same
per-token oracle, exist because each wins somewhere (figures in docs/engine.md):

* "rows" (CPU default for gathers, and for HND scatters): a block of one layer is a list of
  contiguous rows of the cache (NHD: ``head_dim`` elements, one token of one head; HND:
  ``page_tokens * head_dim``, one head of one page), so one numpy ``take`` per (block, layer)
  copies them with memcpy straight into the block (one pass, no scratch, sequential writes);
  the scatter is the inverse fancy-index assignment. One thread, 128 MiB, scattered pages:
  gather 0.56-0.58x (NHD) and 0.68-0.69x (HND) a plain copy, against 0.41-0.44x / 0.50-0.52x
  for "direct" in the same runs.
* "runs" (CPU, when every block's pages are consecutive ids, as a fresh allocator hands them
  out: "auto" for scatters, and for gathers with more than one torch thread): a run of
  consecutive pages is one strided view of the cache, so each run of each layer moves with one
  ``copy_``, which torch splits over its threads.
* "direct" (CPU default for NHD scatters of scattered pages, and the path for non-contiguous
  tensors): one pass per (layer, page slot of a block): ``index_select`` writes straight into a
  strided view of the blocks; scatter is one numpy fancy-index assignment from a strided view
  (numpy moves whole rows with memcpy; torch's ``index_copy_`` was ~3x slower; the "rows"
  scatter's ``head_dim``-element rows were slower still for NHD).
* "staged" (other devices without Triton): page rows into a small scratch that stays in cache,
  then one transpose copy; scatter transposes into a scratch in page order, then writes whole
  page rows.
* "triton" ("auto" on CUDA tensors when triton is installed; on CPU only when asked for, under
  Triton's interpreter, which is how it is tested): one kernel launch per layer moves every
  (block, k|v, head) tile in one pass, see ``kvpool.kernels.paged_triton``.

"rows" and "direct" run layers on ``torch.get_num_threads()`` Python threads for calls of at
least ``PARALLEL_MIN_BYTES`` (torch and numpy release the GIL while copying; these per-layer
ops are too small for torch's own threads to help).

Measured GB/s against a plain copy are in docs/engine.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from kvpool.core.errors import InvalidArgument, SpecMismatch
from kvpool.core.spec import KVSpec
from kvpool.kernels import paged_triton

ORDERS = ("NHD", "HND")

#: KVSpec.dtype -> torch dtype of an engine cache that may be gathered into it.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}

#: Bytes of pages moved per chunk (None in a call = pick from these). Gather: the scratch
#: should stay in L2 (1 MiB per core on the bench machine) between the row gather and the
#: transpose. Scatter: larger chunks amortise the per-call cost of the row writes.
GATHER_CHUNK_BYTES = 1 << 20
SCATTER_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class PagedLayout:
    """How one engine (or one TP rank of it) lays out its per-layer paged KV cache.

    ``head_start``/``num_kv_heads`` are this rank's contiguous slice of the model's kv heads;
    a TP=1 engine has ``head_start=0`` and all heads.
    """

    page_tokens: int
    num_kv_heads: int
    head_dim: int
    order: str = "NHD"
    head_start: int = 0

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise InvalidArgument(f"page order {self.order!r} is not one of {ORDERS}")
        for name in ("page_tokens", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"PagedLayout.{name} must be positive, got {getattr(self, name)}")
        if self.head_start < 0:
            raise InvalidArgument(f"PagedLayout.head_start must be >= 0, got {self.head_start}")

    def page_shape(self, kv_factor: int, num_pages: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor in this layout."""
        if self.order == "NHD":
            return (kv_factor, num_pages, self.page_tokens, self.num_kv_heads, self.head_dim)
        return (kv_factor, num_pages, self.num_kv_heads, self.page_tokens, self.head_dim)


def tp_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(head_start, heads) of ``tp_rank``: contiguous, equal slices, as vLLM/SGLang shard kv heads.

    When ``tp_size > num_kv_heads`` engines replicate kv heads; each rank then holds one head,
    ``tp_size // num_kv_heads`` ranks sharing it.
    """
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise InvalidArgument(f"tp_rank {tp_rank} is outside tp_size {tp_size}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise InvalidArgument(f"{num_kv_heads} kv heads do not split evenly over TP={tp_size}")
        per = num_kv_heads // tp_size
        return tp_rank * per, per
    if tp_size % num_kv_heads:
        raise InvalidArgument(f"TP={tp_size} is not a multiple of {num_kv_heads} kv heads")
    return tp_rank // (tp_size // num_kv_heads), 1


def check_caches(spec: KVSpec, layout: PagedLayout, kv_caches: Sequence[torch.Tensor]) -> int:
    """Refuse a cache of another layout, dtype or head count before a byte moves.

    Returns the number of pages per layer. Raises SpecMismatch naming both sides.
    """
    where = f"engine cache ({layout.order}, page_tokens={layout.page_tokens}, heads "
    where += f"[{layout.head_start}, {layout.head_start + layout.num_kv_heads}), head_dim={layout.head_dim})"
    if len(kv_caches) != spec.num_layers:
        raise SpecMismatch(
            f"{where} has {len(kv_caches)} layers, the pool spec [{spec.describe()}] has {spec.num_layers}",
            hint="connect the engine to a pool namespace of the same model",
        )
    if layout.head_dim != spec.head_dim or layout.head_start + layout.num_kv_heads > spec.num_kv_heads:
        raise SpecMismatch(
            f"{where} does not fit the pool spec [{spec.describe()}]",
            hint="the engine's kv heads/head_dim must be a slice of the pool spec's",
        )
    if layout.page_tokens % spec.block_tokens and spec.block_tokens % layout.page_tokens:
        raise SpecMismatch(
            f"{where}: page_tokens={layout.page_tokens} and block_tokens={spec.block_tokens} do not divide",
            hint="pick a pool block size that is a multiple or a divisor of the engine page size",
        )
    want_dtype = TORCH_DTYPES[spec.dtype]
    num_pages = kv_caches[0].shape[1] if kv_caches[0].dim() == 5 else -1
    want_shape = layout.page_shape(spec.kv_factor, num_pages)
    for i, cache in enumerate(kv_caches):
        if cache.dtype != want_dtype:
            raise SpecMismatch(
                f"{where} layer {i} has dtype {cache.dtype}, the pool spec [{spec.describe()}] wants {want_dtype}",
                hint="use a pool namespace with the engine's KV dtype",
            )
        if tuple(cache.shape) != want_shape:
            raise SpecMismatch(
                f"{where} layer {i} has shape {tuple(cache.shape)}, expected {want_shape} "
                f"for the pool spec [{spec.describe()}]",
                hint="pass the per-layer cache tensors in the layout named by PagedLayout",
            )
    return int(num_pages)


def _block_view(out: torch.Tensor, spec: KVSpec, n: int) -> None:
    if out.dim() != 6 or tuple(out.shape[1:]) != spec.block_shape or out.shape[0] < n:
        raise InvalidArgument(
            f"blocks tensor has shape {tuple(out.shape)}, expected [>={n}, *{spec.block_shape}]",
            hint="allocate with torch.empty(n, *spec.block_shape)",
        )


def _page_table(page_ids: torch.Tensor | Sequence[int], device: torch.device, num_pages: int) -> torch.Tensor:
    """The block table as a flat long tensor on ``device``, every id checked against the cache:
    an id out of range would read or overwrite another request's pages, so it is refused here,
    once, for every strategy."""
    ids = torch.as_tensor(page_ids, dtype=torch.long).reshape(-1)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_pages):
        raise InvalidArgument(f"page ids must lie in [0, {num_pages})")
    return ids.to(device)


def _spans(spec: KVSpec, layout: PagedLayout, num_blocks: int, num_pages_given: int) -> tuple[int, int]:
    """(pages_per_block, blocks_per_page); exactly one of them is > 1 unless sizes are equal."""
    if spec.block_tokens >= layout.page_tokens:
        ppb = spec.block_tokens // layout.page_tokens
        if num_pages_given < num_blocks * ppb:
            raise InvalidArgument(f"{num_blocks} blocks need {num_blocks * ppb} pages, got {num_pages_given}")
        return ppb, 1
    bpp = layout.page_tokens // spec.block_tokens
    if num_pages_given * bpp < num_blocks:
        raise InvalidArgument(f"{num_blocks} blocks need {-(-num_blocks // bpp)} pages, got {num_pages_given}")
    return 1, bpp


def _auto_chunk(spec: KVSpec, layout: PagedLayout, cache: torch.Tensor, chunk_bytes: int) -> int:
    per_block = spec.kv_factor * spec.block_tokens * layout.num_kv_heads * spec.head_dim * cache.element_size()
    return max(1, chunk_bytes // per_block)


#: Same-size integer dtypes, so numpy (which has no bf16/fp8) can move the raw elements.
_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _write_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[rows] = src`` for 2-D contiguous tensors.

    On CPU through numpy: its fancy-index assignment copies whole rows with memcpy, about 3x
    faster than torch's ``index_copy_`` on this machine (measured in docs/engine.md). Other
    devices use ``index_copy_``.
    """
    if dst.device.type == "cpu":
        raw = _RAW[dst.element_size()]
        dst.view(raw).numpy()[rows.numpy()] = src.view(raw).numpy()
    else:
        dst.index_copy_(0, rows, src)


STRATEGIES = ("auto", "direct", "staged", "rows", "runs", "triton")

#: Below this many bytes per call, starting worker threads (~0.1 ms) costs more than it saves.
PARALLEL_MIN_BYTES = 4 << 20
#: "auto" uses "rows" only when one block of one layer is at least this big: each costs one
#: numpy call (~2 us), which "rows" repays at ~45 KB per call over "direct" (measured: with
#: 16 KiB per block and layer, "rows" took 2x as long as "direct").
ROWS_MIN_BYTES = 64 << 10


def _direct(strategy: str, cache: torch.Tensor) -> bool:
    if strategy not in STRATEGIES:
        raise InvalidArgument(f"strategy {strategy!r} is not one of {STRATEGIES}")
    if strategy in ("direct", "rows", "runs") and cache.device.type != "cpu":
        raise InvalidArgument(f"the {strategy} strategy runs on CPU tensors only", hint="use 'auto' or 'staged'")
    return strategy != "staged" and cache.device.type == "cpu"


def _use_triton(strategy: str, cache: torch.Tensor) -> bool:
    """The Triton kernels run when asked for ("triton": CUDA, or CPU under Triton's interpreter)
    and for "auto" on CUDA tensors when triton is installed. CPU "auto" never takes them."""
    if strategy == "triton":
        if not paged_triton.available(cache.device):
            raise InvalidArgument(
                f"the triton strategy cannot run on {cache.device} tensors here",
                hint="install triton and use CUDA tensors (or TRITON_INTERPRET=1 for CPU tests), or use 'auto'",
            )
        return True
    return strategy == "auto" and cache.device.type == "cuda" and paged_triton.available(cache.device)


def _block_runs(table: torch.Tensor, num_blocks: int, ppb: int) -> list[tuple[int, int, int]] | None:
    """``(first_block, end_block, first_page)`` runs of blocks whose pages follow each other.

    None unless every block's pages are consecutive ids. A run is a maximal span of blocks
    whose pages are also consecutive from one block to the next (pages ``i, i+1, ...``, as a
    fresh engine allocator hands them out); it is one strided view of the cache, so it moves
    with a single ``copy_`` per layer instead of a page-table lookup per page.
    """
    slots = table[: num_blocks * ppb].numpy().reshape(num_blocks, ppb)
    if ppb > 1 and not (np.diff(slots, axis=1) == 1).all():
        return None
    starts = slots[:, 0]
    cuts = [0, *(np.flatnonzero(np.diff(starts) != ppb) + 1).tolist(), num_blocks]
    return [(s, e, int(starts[s])) for s, e in pairwise(cuts)]


def _pick_cpu(
    strategy: str,
    caches: Sequence[torch.Tensor],
    blocks: torch.Tensor,
    table: torch.Tensor,
    n: int,
    ppb: int,
    gather: bool,
    order: str,
    block_layer_bytes: int,
) -> tuple[str, list[tuple[int, int, int]] | None]:
    """The CPU path for a call (page size <= block size) and, for "runs", the runs.

    "auto" takes "rows" (one pass, whole contiguous rows, measured fastest with one thread for
    both orders and any page table), except "runs" when every block's pages are consecutive
    and there are few runs (at most 4, or a quarter of the blocks: each run costs one op per
    layer) for a scatter, or a gather with more than one torch thread (torch then splits each
    big copy over its threads). An NHD scatter stays "direct": numpy's fancy-index assignment
    of ``head_dim``-element rows measured 0.30-0.38x a plain copy, below "direct" (0.49-0.64x).
    "rows" costs one numpy call per (block, layer), so it is taken only when one block of one
    layer moves at least ``ROWS_MIN_BYTES`` (small models: "direct" or "runs", fewer calls).
    "rows" and "runs" need contiguous tensors (they address them as flat rows or one view);
    "direct" takes the rest.
    """
    contiguous = all(c.is_contiguous() for c in caches)
    runs = _block_runs(table, n, ppb) if strategy in ("auto", "runs") and contiguous else None
    if strategy == "runs":
        if runs is None:
            raise InvalidArgument(
                "the runs strategy needs contiguous caches and consecutive page ids within each block",
                hint="use 'auto'",
            )
        return "runs", runs
    rows_ok = contiguous and blocks.is_contiguous()
    if strategy == "rows" and not rows_ok:
        raise InvalidArgument("the rows strategy needs contiguous blocks and caches", hint="use 'auto'")
    if strategy == "auto":
        big = block_layer_bytes >= ROWS_MIN_BYTES
        few_runs = runs is not None and len(runs) <= max(4, n // 4)
        if few_runs and (not gather or not big or torch.get_num_threads() > 1):
            return "runs", runs
        if rows_ok and big and (gather or order == "HND"):
            return "rows", None
        return "direct", None
    return strategy, None


def _row_ids(spec: KVSpec, layout: PagedLayout, slots: torch.Tensor, num_pages: int) -> np.ndarray:
    """Per block, the cache rows (flat ``[-1, row]`` view) in the order of the block's rows.

    A row is ``head_dim`` elements (NHD: one token of one head) or ``page_tokens * head_dim``
    (HND: one head of one page). Block rows run ``[kv][head][page slot][token]`` (NHD) or
    ``[kv][head][page slot]`` (HND), so the rows of ``out[b, layer, kv, heads]`` are contiguous.
    """
    kvf, hn, p = spec.kv_factor, layout.num_kv_heads, layout.page_tokens
    n, ppb = slots.shape
    kv = torch.arange(kvf).view(1, kvf, 1, 1, 1)
    head = torch.arange(hn).view(1, 1, hn, 1, 1)
    page = (kv * num_pages + slots.view(n, 1, 1, ppb, 1)).expand(n, kvf, hn, ppb, 1)
    if layout.order == "NHD":
        ids = (page * p + torch.arange(p).view(1, 1, 1, 1, p)) * hn + head
    else:
        ids = page * hn + head
    return ids.reshape(n, kvf, -1).numpy()


def _run_layers(num_layers: int, workers: int, work: Callable[[range], None]) -> None:
    """``work`` over all layers, split into ``workers`` strided sets run on threads.

    torch and numpy release the GIL while they copy, so two threads use both cores; one torch
    op is parallel inside only when it is big, and these ops are per (block or page slot, layer).
    Layers write disjoint memory, so the threads need no locks. torch's inference and grad
    modes are per thread: the workers take the caller's, or an engine running under
    ``torch.inference_mode`` (vLLM) could not write its inference tensors from them.
    """
    workers = max(1, min(workers, num_layers))
    if workers == 1:
        work(range(num_layers))
        return
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def in_callers_mode(layers: range) -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            work(layers)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(in_callers_mode, [range(w, num_layers, workers) for w in range(workers)]))


def _workers(workers: int | None, nbytes: int, path: str) -> int:
    """Threads over layers. "runs" stays on the caller's thread: each of its copies is big
    enough for torch to split over its own threads, and Python threads on top measured slower
    (two levels of threads on two cores)."""
    if workers is not None and workers < 1:
        raise InvalidArgument(f"workers must be >= 1, got {workers}")
    if path == "runs":
        return 1
    if workers is not None:
        return workers
    return torch.get_num_threads() if nbytes >= PARALLEL_MIN_BYTES else 1


def _token_view(pages: torch.Tensor, layout: PagedLayout, n_pages: int, kvf: int) -> torch.Tensor:
    """Gathered pages [kv * n_pages, page elems] -> [n_pages_tokens..] as [kv, heads, tokens, dim] view."""
    h, p, d = layout.num_kv_heads, layout.page_tokens, layout.head_dim
    if layout.order == "NHD":  # [kv, n, tok, h, d] -> [kv, h, n, tok, d]
        return pages.view(kvf, n_pages, p, h, d).permute(0, 3, 1, 2, 4)
    return pages.view(kvf, n_pages, h, p, d).permute(0, 2, 1, 3, 4)


def _run_pairs(
    spec: KVSpec, layout: PagedLayout, cache: torch.Tensor, blocks: torch.Tensor, layer: int, run: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache view, blocks view) of one run of one layer, same shape: one ``copy_`` moves it."""
    s, e, page0 = run
    n, kvf, h0, hn = e - s, spec.kv_factor, layout.head_start, layout.num_kv_heads
    t, d, p = spec.block_tokens, spec.head_dim, layout.page_tokens
    ppb = t // p
    pages = cache[:, page0 : page0 + n * ppb]  # contiguous pages: [kv, n * ppb, (page dims)]
    blk = blocks[s:e, layer, :, h0 : h0 + hn]  # [n, kv, hn, t, d]
    if layout.order == "NHD":  # [kv, n, t, hn, d] -> [n, kv, hn, t, d]
        return pages.view(kvf, n, t, hn, d).permute(1, 0, 3, 2, 4), blk
    return pages.view(kvf, n, ppb, hn, p, d).permute(1, 0, 3, 2, 4, 5), blk.unflatten(3, (ppb, p))


def gather_blocks(
    spec: KVSpec,
    layout: PagedLayout,
    kv_caches: Sequence[torch.Tensor],
    page_ids: torch.Tensor | Sequence[int],
    out: torch.Tensor,
    num_blocks: int,
    *,
    chunk_blocks: int | None = None,
    strategy: str = "auto",
    workers: int | None = None,
) -> None:
    """Copy ``num_blocks`` consecutive blocks of a request from the paged cache into ``out``.

    ``page_ids`` is the request's block table (engine page ids in token order). ``out`` is
    ``[>=num_blocks, *spec.block_shape]``; only this layout's head range is written.
    ``strategy`` (all give the same bytes; see the module docstring for why each exists):
    "runs" (consecutive page ids: one strided copy per run and layer; CPU), "rows" (one numpy
    ``take`` of whole contiguous rows per block and layer, straight into the block; CPU),
    "direct" (``index_select`` straight into a strided view of the blocks, per layer and page
    slot; CPU), "staged" (rows into a small scratch, then one transpose copy; other devices
    without Triton), "triton" (``paged_triton``: one kernel launch per layer; CUDA, or CPU under
    Triton's interpreter), "auto" picks by device, page table and thread count (CUDA with triton
    installed: "triton"). ``workers``: CPU threads over layers (None: torch's thread count for
    calls of at least ``PARALLEL_MIN_BYTES``, else one).
    """
    num_pages = check_caches(spec, layout, kv_caches)
    _block_view(out, spec, num_blocks)
    if num_blocks == 0:
        return
    table = _page_table(page_ids, kv_caches[0].device, num_pages)
    ppb, bpp = _spans(spec, layout, num_blocks, table.numel())
    kvf, h0, hn = spec.kv_factor, layout.head_start, layout.num_kv_heads
    t, d = spec.block_tokens, spec.head_dim
    if _use_triton(strategy, kv_caches[0]):
        cache0 = kv_caches[0]
        same = out.device == cache0.device and out.dtype == cache0.dtype
        # else gather on the cache's device, then one copy (converting dtype like the torch paths)
        dst = out if same else torch.empty(num_blocks, *spec.block_shape, dtype=cache0.dtype, device=cache0.device)
        paged_triton.gather(
            kv_caches,
            table,
            dst,
            num_blocks,
            order=layout.order,
            page_tokens=layout.page_tokens,
            head_start=h0,
            heads=hn,
        )
        if not same:
            out[:num_blocks, :, :, h0 : h0 + hn].copy_(dst[:, :, :, h0 : h0 + hn])
        return
    if _direct(strategy, kv_caches[0]) and bpp == 1:
        block_layer_bytes = kvf * hn * t * d * out.element_size()
        nbytes = num_blocks * spec.num_layers * block_layer_bytes
        path, runs = _pick_cpu(
            strategy,
            kv_caches,
            out,
            table,
            num_blocks,
            ppb,
            gather=True,
            order=layout.order,
            block_layer_bytes=block_layer_bytes,
        )
        p = layout.page_tokens
        raw = _RAW[out.element_size()]
        slots = table[: num_blocks * ppb].view(num_blocks, ppb)
        if path == "rows":
            row = d if layout.order == "NHD" else p * d
            ids = _row_ids(spec, layout, slots, num_pages)
            out_np = out.view(raw).numpy()
            whole = hn == spec.num_kv_heads  # then all kv halves of a block are one row range

        def work(layers: range) -> None:
            if path == "runs":
                for layer in layers:
                    for run in runs or ():
                        src, dst = _run_pairs(spec, layout, kv_caches[layer], out, layer, run)
                        dst.copy_(src)
            elif path == "rows":  # one numpy take (memcpy of whole rows) per block and layer
                for layer in layers:
                    cache_np = kv_caches[layer].view(raw).numpy().reshape(-1, row)  # a view: contiguous
                    for b in range(num_blocks):
                        if whole:
                            dst_np = out_np[b, layer].reshape(-1, row)
                            np.take(cache_np, ids[b].reshape(-1), axis=0, out=dst_np, mode="clip")  # ids checked
                            continue
                        for k in range(kvf):
                            dst_np = out_np[b, layer, k, h0 : h0 + hn].reshape(-1, row)
                            np.take(cache_np, ids[b, k], axis=0, out=dst_np, mode="clip")
            else:  # direct: page slot j of every block, one pass, no scratch
                for layer in layers:
                    for j in range(ppb):
                        dst = out[:num_blocks, layer, :, h0 : h0 + hn, j * p : (j + 1) * p]  # [n, kv, hn, p, d]
                        view = dst.permute(1, 0, 3, 2, 4) if layout.order == "NHD" else dst.permute(1, 0, 2, 3, 4)
                        if num_blocks == 1:  # one page: a copy (index_select of one id ran ~0.03-0.1 GB/s)
                            page = int(slots[0, j])
                            view.copy_(kv_caches[layer][:, page : page + 1])
                        else:
                            torch.index_select(kv_caches[layer], 1, slots[:, j], out=view)

        _run_layers(spec.num_layers, _workers(workers, nbytes, path), work)
        return
    row = layout.page_tokens * hn * d
    chunk_blocks = chunk_blocks or _auto_chunk(spec, layout, kv_caches[0], GATHER_CHUNK_BYTES)
    max_pages = kvf * (chunk_blocks * ppb if bpp == 1 else chunk_blocks // bpp + 2)
    scratch_t = torch.empty(max_pages, row, dtype=kv_caches[0].dtype, device=kv_caches[0].device)
    for s in range(0, num_blocks, chunk_blocks):
        e = min(num_blocks, s + chunk_blocks)
        n = e - s
        if bpp == 1:
            pages = table[s * ppb : e * ppb]
        else:
            pages = table[s // bpp : (e - 1) // bpp + 1]
        n_pages = pages.numel()
        idx = torch.cat([pages + k * num_pages for k in range(kvf)])
        for layer, cache in enumerate(kv_caches):
            got_t = scratch_t[: idx.numel()]
            torch.index_select(cache.view(kvf * num_pages, row), 0, idx, out=got_t)
            dst_t = out[s:e, layer, :, h0 : h0 + hn]  # [n, kv, hn, t, d]
            if bpp == 1:  # one copy: [kv, n, ppb, (page dims)] -> [n, kv, hn, ppb, page, d]
                if layout.order == "NHD":
                    src = got_t.view(kvf, n, ppb, layout.page_tokens, hn, d).permute(1, 0, 4, 2, 3, 5)
                else:
                    src = got_t.view(kvf, n, ppb, hn, layout.page_tokens, d).permute(1, 0, 3, 2, 4, 5)
                dst_t.unflatten(3, (ppb, layout.page_tokens)).copy_(src)
            else:
                toks_t = _token_view(got_t, layout, n_pages, kvf).reshape(kvf, hn, n_pages * layout.page_tokens, d)
                first_tok = (s % bpp) * t
                toks_t = toks_t[:, :, first_tok : first_tok + n * t]
                dst_t.copy_(toks_t.reshape(kvf, hn, n, t, d).permute(2, 0, 1, 3, 4))


def scatter_blocks(
    spec: KVSpec,
    layout: PagedLayout,
    blocks: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    page_ids: torch.Tensor | Sequence[int],
    num_blocks: int,
    *,
    chunk_blocks: int | None = None,
    strategy: str = "auto",
    workers: int | None = None,
) -> None:
    """Write ``num_blocks`` canonical blocks into the request's pages (this layout's heads only).

    ``strategy`` as for ``gather_blocks``: "runs" writes each run of consecutive pages with one
    strided copy per layer; "direct" writes each page slot of every block with one numpy
    fancy-index assignment from a strided view (CPU only); "staged" transposes a chunk into page
    order first, then writes whole page rows; "rows" writes the rows of one block and layer with
    one numpy fancy-index assignment (the inverse of the "rows" gather); "triton" runs the
    ``paged_triton`` scatter kernel.
    ``workers`` as for ``gather_blocks``.

    When one engine page holds several pool blocks, a page is written only where its tokens
    are covered by the given blocks; the rest of the page is left as it was.
    """
    num_pages = check_caches(spec, layout, kv_caches)
    _block_view(blocks, spec, num_blocks)
    if num_blocks == 0:
        return
    if blocks.dtype != kv_caches[0].dtype:
        raise SpecMismatch(f"blocks have dtype {blocks.dtype}, the cache holds {kv_caches[0].dtype}")
    device = kv_caches[0].device
    table = _page_table(page_ids, device, num_pages)
    ppb, bpp = _spans(spec, layout, num_blocks, table.numel())
    kvf, h0, hn = spec.kv_factor, layout.head_start, layout.num_kv_heads
    t, d, p = spec.block_tokens, spec.head_dim, layout.page_tokens
    src_all = blocks.to(device) if blocks.device != device else blocks
    if _use_triton(strategy, kv_caches[0]):
        paged_triton.scatter(
            src_all, kv_caches, table, num_blocks, order=layout.order, page_tokens=p, head_start=h0, heads=hn
        )
        return
    if _direct(strategy, kv_caches[0]) and bpp == 1:
        block_layer_bytes = kvf * hn * t * d * blocks.element_size()
        nbytes = num_blocks * spec.num_layers * block_layer_bytes
        path, runs = _pick_cpu(
            strategy,
            kv_caches,
            src_all,
            table,
            num_blocks,
            ppb,
            gather=False,
            order=layout.order,
            block_layer_bytes=block_layer_bytes,
        )
        raw = _RAW[blocks.element_size()]
        slots = table[: num_blocks * ppb].view(num_blocks, ppb).numpy()
        if path == "rows":
            row = d if layout.order == "NHD" else p * d
            ids = _row_ids(spec, layout, torch.from_numpy(slots), num_pages)
            src_np_all = src_all.view(raw).numpy()
            whole = hn == spec.num_kv_heads

        def work(layers: range) -> None:
            for layer in layers:
                if path == "runs":
                    for run in runs or ():
                        dst, src = _run_pairs(spec, layout, kv_caches[layer], src_all, layer, run)
                        dst.copy_(src)
                    continue
                if path == "rows":  # one fancy-index assignment of whole rows per block and layer
                    cache_np = kv_caches[layer].view(raw).numpy().reshape(-1, row)  # a view: contiguous
                    for b in range(num_blocks):
                        if whole:
                            cache_np[ids[b].reshape(-1)] = src_np_all[b, layer].reshape(-1, row)
                            continue
                        for k in range(kvf):
                            cache_np[ids[b, k]] = src_np_all[b, layer, k, h0 : h0 + hn].reshape(-1, row)
                    continue
                dst_np = kv_caches[layer].view(raw).numpy()
                src_np = src_all[:num_blocks, layer, :, h0 : h0 + hn].view(raw).numpy()  # [n, kv, hn, t, d]
                for j in range(ppb):
                    part = src_np[:, :, :, j * p : (j + 1) * p]  # [n, kv, hn, p, d]
                    if layout.order == "NHD":
                        dst_np[:, slots[:, j]] = part.transpose(1, 0, 3, 2, 4)  # [kv, n, p, hn, d]
                    else:
                        dst_np[:, slots[:, j]] = part.transpose(1, 0, 2, 3, 4)  # [kv, n, hn, p, d]

        threads = _workers(workers, nbytes, path)
        if len({c.data_ptr() for c in kv_caches}) < len(kv_caches):
            threads = 1  # one tensor passed for two layers: keep the serial "last layer wins" writes
        _run_layers(spec.num_layers, threads, work)
        return
    chunk_blocks = chunk_blocks or _auto_chunk(spec, layout, kv_caches[0], SCATTER_CHUNK_BYTES)
    scratch = torch.empty(kvf * chunk_blocks * ppb * p * hn * d, dtype=blocks.dtype, device=device)
    for s in range(0, num_blocks, chunk_blocks):
        e = min(num_blocks, s + chunk_blocks)
        n = e - s
        for layer, cache in enumerate(kv_caches):
            src = src_all[s:e, layer, :, h0 : h0 + hn]  # [n, kv, hn, t, d]
            if bpp == 1:
                pages = table[s * ppb : e * ppb]
                split = src.unflatten(3, (ppb, p))  # [n, kv, hn, ppb, p, d]
                staged = scratch[: kvf * n * ppb * p * hn * d]
                if layout.order == "NHD":  # -> [kv, n, ppb, p, hn, d] in the scratch
                    staged.view(kvf, n, ppb, p, hn, d).copy_(split.permute(1, 0, 3, 4, 2, 5))
                else:  # -> [kv, n, ppb, hn, p, d]
                    staged.view(kvf, n, ppb, hn, p, d).copy_(split.permute(1, 0, 3, 2, 4, 5))
                rows = torch.cat([pages + k * num_pages for k in range(kvf)])
                _write_rows(cache.view(kvf * num_pages, -1), rows, staged.view(kvf * n * ppb, -1))
            else:
                tokens = src.permute(1, 2, 0, 3, 4).reshape(kvf, hn, n * t, d)  # [kv, hn, tok, d]
                for b in range(s, e):  # sub-page blocks: write each block's token slice of its page
                    page = int(table[b // bpp])
                    tok0 = (b % bpp) * t
                    blk = tokens[:, :, (b - s) * t : (b - s + 1) * t]
                    if layout.order == "NHD":
                        cache[:, page, tok0 : tok0 + t].copy_(blk.permute(0, 2, 1, 3))
                    else:
                        cache[:, page, :, tok0 : tok0 + t].copy_(blk)


def convert_order(cache: torch.Tensor, src_order: str, dst_order: str) -> torch.Tensor:
    """NHD <-> HND of one layer's cache ``[kv, pages, ...]``; a new contiguous tensor."""
    if src_order not in ORDERS or dst_order not in ORDERS:
        raise InvalidArgument(f"orders must be among {ORDERS}, got {src_order!r} -> {dst_order!r}")
    if cache.dim() != 5:
        raise InvalidArgument(f"a layer cache is 5-D [kv, pages, a, b, head_dim], got {tuple(cache.shape)}")
    if src_order == dst_order:
        return cache.clone()
    return cache.transpose(2, 3).contiguous()


def blocks_to_tokens(blocks: torch.Tensor, layer: int) -> torch.Tensor:
    """One layer of ``[n, *block_shape]`` blocks as ``[kv, heads, n * block_tokens, head_dim]`` (a copy)."""
    n, _, kvf, h, t, d = blocks.shape
    return blocks[:, layer].permute(1, 2, 0, 3, 4).reshape(kvf, h, n * t, d)


def tokens_to_blocks(tokens: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    """Inverse of ``blocks_to_tokens``: ``[kv, heads, n * block_tokens, head_dim]`` into ``out[:, layer]``."""
    n, _, kvf, h, t, d = out.shape
    if tuple(tokens.shape) != (kvf, h, n * t, d):
        raise InvalidArgument(f"tokens shape {tuple(tokens.shape)} != {(kvf, h, n * t, d)}")
    out[:, layer].copy_(tokens.reshape(kvf, h, n, t, d).permute(2, 0, 1, 3, 4))
