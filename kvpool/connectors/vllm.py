"""vLLM ``KVConnectorBase_V1`` adapter (vLLM 0.32): vLLM's paged KV <-> the pool's canonical blocks.

Configure vLLM with (docs/vllm.md has the multi-instance and prefill/decode lines)::

    --kv-transfer-config '{"kv_connector": "KvpoolConnector", "kv_role": "kv_both",
      "kv_connector_module_path": "kvpool.connectors.vllm",
      "kv_connector_extra_config": {"pool_address": "127.0.0.1:7450", "salt": "tenant-a"}}'

The split follows vLLM's own ``kv_offload``: the scheduler side decides what to load and
save and sends a small message (``ConnectorMetadata``) to the worker side, which moves bytes.

Scheduler side: ``get_num_new_matched_tokens`` hashes the prompt in the pool namespace and
asks the pool how many whole pool blocks beyond vLLM's own (block-aligned) prefix hit it
holds, never the last prompt token; ``update_state_after_alloc`` records which block ids
those go to; ``build_connector_meta`` hands the loads and the saves (prompt blocks that
become complete in this step, past what the pool already had) to the workers.

Worker side: ``register_kv_caches`` reads the layout from what vLLM reports — the
attention backend of each layer and the registered ``[B, H, N, C]`` tensors
(``vllm_layout``) — and refuses what it does not know. ``start_load_kv`` leases blocks and
scatters them from the arena straight into the pages (synchronously, before the forward;
``paged_io.load_blocks``: each run verified right before it is scattered, no staging
buffer); a block that fails verification (or a pool that vanished) is not scattered and
its block ids are reported by ``get_block_ids_with_load_errors`` so vLLM recomputes them.
``wait_for_save`` starts a put and gathers the completed blocks straight into its arena
slots, checksummed as they are written (on the engine's step: vLLM may reuse the pages
after it), and queues the commit for a background thread, so the commit round trip and
the node's verification never stall the step; more than ``max_pending_save_bytes`` staged
and not committed drops the save (counted: the pool is a cache).

Anything unsupported (see ``vllm_spec``) or a pool that is not there makes the connector
inert with one clear log line and vLLM serves on without it, unless the option
``strict`` is set, in which case the engine refuses to start.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpool.connectors.paged_io import load_blocks, stage_blocks
from kvpool.connectors.pool_api import BlockPool, Staged
from kvpool.connectors.vllm_layout import VllmCacheLayout, describe_caches, kv_view, manager_to_kernel_pages
from kvpool.core.errors import InvalidArgument, KVPoolError
from kvpool.core.spec import KVSpec
from kvpool.kernels.paged import PagedLayout, check_caches, gather_blocks, scatter_blocks, tp_head_range

log = logging.getLogger("kvpool.connectors.vllm")

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class BlockTransfer:
    """Pool blocks of a request and the vLLM block ids that hold exactly those blocks."""

    request_id: str
    hashes: tuple[bytes, ...]
    page_ids: tuple[int, ...]  # vLLM (scheduler) block ids covering these pool blocks, in order


@dataclass
class ConnectorMetadata:
    """Scheduler -> worker, once per step (vLLM pickles it; plain fields only)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class ConnectorStats:
    """What the connector did; written as JSON by the option ``stats_path`` at shutdown."""

    lookups: int = 0
    lookup_prompt_tokens: int = 0
    hit_tokens: int = 0  # tokens offered to vLLM beyond its own prefix cache
    load_blocks: int = 0
    load_failed_blocks: int = 0
    saved_blocks: int = 0
    dropped_save_blocks: int = 0
    steps: int = 0
    load_s: float = 0.0  # engine-step time in start_load_kv
    save_s: float = 0.0  # engine-step time in wait_for_save (the gather)
    scheduler_s: float = 0.0  # scheduler time in lookups and planning


def pages_for_blocks(block_ids: Sequence[int], first_block: int, num_blocks: int, pages_per_block: int) -> list[int]:
    """Block ids of pool blocks [first_block, first_block + num_blocks) from a request's block table."""
    start, end = first_block * pages_per_block, (first_block + num_blocks) * pages_per_block
    if end > len(block_ids):
        raise InvalidArgument(f"block table has {len(block_ids)} blocks, {end} needed for pool blocks up to {end}")
    return list(block_ids[start:end])


def layer_order(names: Sequence[str]) -> list[str]:
    """vLLM layer names (``model.layers.12.self_attn.attn``) sorted by their layer index."""

    def index(name: str) -> int:
        m = _LAYER_INDEX.search("." + name + ".")
        if m is None:
            raise InvalidArgument(f"cannot find a layer index in {name!r}")
        return int(m.group(1))

    return sorted(names, key=index)


class BackgroundSaver:
    """One named thread that commits staged saves, bounded by the bytes staged and not yet committed.

    The caller stages a save on its own thread (the engine step: its pages are gathered
    straight into the put's arena slots, ``paged_io.stage_blocks``, because vLLM may reuse
    them after the step); the commit round trip, and the node's verification of the bytes,
    run here, off the step.
    """

    def __init__(self, pool: BlockPool, max_pending_bytes: int, stats: ConnectorStats) -> None:
        """Commits saves to ``pool`` on one background thread, with at most ``max_pending_bytes``
        staged and not committed (more is dropped and counted in ``stats``: a save is an
        optimisation, never a stall).
        """
        self._pool = pool
        self._max_pending_bytes = max_pending_bytes
        self._stats = stats
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[int, int, Staged] | None] = queue.SimpleQueue()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="kvpool-vllm-saver", daemon=True)
        self._thread.start()

    def submit(self, hashes: Sequence[bytes], nbytes: int, stage: Callable[[], Staged | None]) -> bool:
        """Run ``stage`` now (it writes the blocks of ``hashes``, ``nbytes`` in all) and queue
        its commit; False (and counted, ``stage`` not run) when that would exceed the bound."""
        with self._lock:
            if self._pending_bytes + nbytes > self._max_pending_bytes:
                self._stats.dropped_save_blocks += len(hashes)
                return False
            self._pending_bytes += nbytes
        try:
            staged = stage()
        except KVPoolError as err:  # a refused PutStart (full, busy, denied): a lost cache entry
            self._done(nbytes)
            log.warning("kvpool: a save of %d blocks was not staged: %s", len(hashes), err)
            self._stats.dropped_save_blocks += len(hashes)
            return False
        except BaseException:
            self._done(nbytes)
            raise
        if staged is None:  # the pool is down: nothing was written
            self._done(nbytes)
            return False
        self._queue.put((len(hashes), nbytes, staged))
        return True

    def _done(self, nbytes: int) -> None:
        with self._lock:
            self._pending_bytes -= nbytes
            self._idle.notify_all()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            count, nbytes, staged = item
            try:
                staged.commit()
                self._stats.saved_blocks += count
            except KVPoolError as err:  # a refused put is a lost cache entry, never an engine error
                log.warning("kvpool: a save of %d blocks failed: %s", count, err)
                self._stats.dropped_save_blocks += count
            finally:
                self._done(nbytes)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued save is committed (tests, shutdown)."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending_bytes == 0, timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the queued commits (up to ``timeout_s``) and stop the thread."""
        self.drain(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout_s)


class VllmPoolConnectorLogic:
    """Both sides of the connector without vLLM: requests are passed in as plain values.

    ``block_size`` is vLLM's (scheduler) block size; the pool block is a whole number of them.
    """

    def __init__(
        self,
        spec: KVSpec,
        pool: BlockPool,
        block_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        head_allgather: Callable[[torch.Tensor], torch.Tensor] | None = None,
        max_pending_save_bytes: int = 256 << 20,
    ) -> None:
        """``head_allgather`` (needed to save with TP > 1): concatenates every TP rank's
        ``[n, layers, kv, local_heads, tokens, dim]`` tensor along dim 3 in rank order, e.g.
        vLLM's ``get_tp_group().all_gather(t, dim=3)``. Rank 0 then puts whole blocks."""
        if block_size <= 0 or spec.block_tokens % block_size:
            raise InvalidArgument(
                f"pool block_tokens {spec.block_tokens} must be a multiple of vLLM block_size {block_size}"
            )
        self.spec = spec
        self.pool = pool
        self.block_size = block_size
        self.pages_per_block = spec.block_tokens // block_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.head_start, self.local_heads = tp_head_range(spec.num_kv_heads, tp_size, tp_rank)
        self.head_allgather = head_allgather
        self.max_pending_save_bytes = max_pending_save_bytes
        self.stats = ConnectorStats()
        # scheduler side
        self._hashes: dict[str, list[bytes]] = {}
        self._offered: dict[str, tuple[int, int]] = {}  # req -> (local computed tokens, tokens offered)
        self._pending_loads: list[BlockTransfer] = []
        self._saved_blocks: dict[str, int] = {}  # req -> pool blocks already in the pool or planned
        # worker side
        self._views: list[torch.Tensor] = []
        self._cache_layout: VllmCacheLayout | None = None
        self._paged: PagedLayout | None = None
        self._load_errors: set[int] = set()
        self._saver: BackgroundSaver | None = None

    # -- scheduler side -------------------------------------------------------------------
    def request_hashes(self, request_id: str, token_ids: Sequence[int]) -> list[bytes]:
        """The pool hash chain of a request's prompt, computed once per request id."""
        if request_id not in self._hashes:
            self._hashes[request_id] = self.pool.hashes(list(token_ids))
        return self._hashes[request_id]

    def get_num_new_matched_tokens(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(tokens the pool adds beyond vLLM's own prefix cache, load asynchronously?)."""
        t0 = time.perf_counter()
        try:
            t = self.spec.block_tokens
            usable = (len(token_ids) - 1) // t  # never the last prompt token: vLLM must compute it
            if num_computed_tokens % t or usable == 0:
                # vLLM's own hit ends inside a pool block: loading it would rewrite pages vLLM
                # holds (and may share with running requests). Assume those blocks are stored.
                self._saved_blocks[request_id] = num_computed_tokens // t
                return 0, False
            hashes = self.request_hashes(request_id, token_ids)
            self.stats.lookups += 1
            self.stats.lookup_prompt_tokens += len(token_ids)
            hit_blocks = self.pool.lookup(hashes[:usable])
            # saves start where the pool's prefix ends, also under vLLM's own hit: a block the
            # pool lost (evicted, corrupt, restarted) is stored again by whoever has it
            self._saved_blocks[request_id] = hit_blocks
            extra = max(0, hit_blocks * t - num_computed_tokens)
            if extra:
                self._offered[request_id] = (num_computed_tokens, extra)
            return extra, False
        finally:
            self.stats.scheduler_s += time.perf_counter() - t0

    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Record the load of the offered pool blocks into their block ids."""
        offered = self._offered.pop(request_id, None)
        if num_external_tokens <= 0 or offered is None:
            return
        local, extra = offered
        t = self.spec.block_tokens
        if num_external_tokens > extra or num_external_tokens % t:
            # vLLM would treat pages nobody fills as computed: refuse loudly rather than serve them
            raise InvalidArgument(f"vLLM accepted {num_external_tokens} external tokens; the pool offered {extra}")
        first, count = local // t, num_external_tokens // t
        hashes = self._hashes[request_id][first : first + count]
        pages = pages_for_blocks(block_ids, first, count, self.pages_per_block)
        self._pending_loads.append(BlockTransfer(request_id, tuple(hashes), tuple(pages)))
        self.stats.hit_tokens += num_external_tokens

    def plan_save(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        block_ids: Sequence[int],
        num_computed_tokens: int,
        num_scheduled_tokens: int,
    ) -> BlockTransfer | None:
        """The prompt blocks that become complete in this step and are not in the pool yet."""
        t = self.spec.block_tokens
        done_tokens = min(len(prompt_token_ids), num_computed_tokens + num_scheduled_tokens)
        full = done_tokens // t
        first = self._saved_blocks.get(request_id, 0)
        if full <= first:
            return None
        hashes = self.request_hashes(request_id, prompt_token_ids)[first:full]
        pages = pages_for_blocks(block_ids, first, full - first, self.pages_per_block)
        self._saved_blocks[request_id] = full
        return BlockTransfer(request_id, tuple(hashes), tuple(pages))

    def build_connector_meta(self, saves: Sequence[BlockTransfer]) -> ConnectorMetadata:
        """The metadata the scheduler sends the workers for one step: the loads planned since the last step and
        ``saves``.
        """
        meta = ConnectorMetadata(loads=self._pending_loads, saves=list(saves))
        self._pending_loads = []
        return meta

    def request_finished(self, request_id: str) -> tuple[bool, dict[str, Any] | None]:
        """Forget a finished request; (False, None): vLLM may free its pages at once (saves copy them first)."""
        self._hashes.pop(request_id, None)
        self._offered.pop(request_id, None)
        self._saved_blocks.pop(request_id, None)
        return False, None  # saves were gathered in the step that completed them

    # -- worker side ------------------------------------------------------------------------
    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], backend: str, num_blocks: int | None = None
    ) -> VllmCacheLayout:
        """Take vLLM's ``[B, H, N, C]`` per-layer tensors; ``backend`` is the attention
        backend's ``get_name()``, ``num_blocks`` the scheduler's block count (None: B)."""
        ordered = [kv_caches[name] for name in layer_order(list(kv_caches))]
        blocks = num_blocks if num_blocks is not None else int(ordered[0].shape[0])
        layout = describe_caches(backend, ordered, blocks, self.spec.head_dim)
        if layout.manager_block_tokens != self.block_size:
            raise InvalidArgument(
                f"vLLM pages of {layout.page_tokens} tokens x {layout.pages_per_manager_block} do not make "
                f"its block size {self.block_size}"
            )
        views = [kv_view(c, layout) for c in ordered]
        paged = PagedLayout(layout.page_tokens, layout.num_kv_heads, self.spec.head_dim, "HND", self.head_start)
        check_caches(self.spec, paged, views)  # refuse another dtype/heads/layers before a byte moves
        self._cache_layout, self._paged, self._views = layout, paged, views
        if self._saver is None and (self.tp_size == 1 or self.tp_rank == 0):
            self._saver = BackgroundSaver(self.pool, self.max_pending_save_bytes, self.stats)
        return layout

    def _kernel_pages(self, page_ids: Sequence[int]) -> list[int]:
        assert self._cache_layout is not None, "register_kv_caches first"
        return manager_to_kernel_pages(page_ids, self._cache_layout.pages_per_manager_block)

    def _buffer(self, n: int, spec: KVSpec | None = None) -> torch.Tensor:
        return torch.empty(n, *(spec or self.spec).block_shape, dtype=self._views[0].dtype)  # fully overwritten

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        """Worker side: copy the planned pool blocks into vLLM's pages (a block that fails its checksum is
        reported through ``get_block_ids_with_load_errors`` and recomputed).
        """
        if not metadata.loads:
            return
        t0 = time.perf_counter()
        assert self._paged is not None, "register_kv_caches first"
        paged, views = self._paged, self._views
        for load in metadata.loads:
            n = len(load.hashes)
            pages = self._kernel_pages(load.page_ids)
            per = len(pages) // n  # kernel pages per pool block

            def scatter(first: int, count: int, blocks: torch.Tensor, pages: list[int] = pages, per: int = per) -> None:
                scatter_blocks(self.spec, paged, blocks, views, pages[first * per : (first + count) * per], count)

            # straight from the leased arena bytes into the pages, each run verified first
            got = load_blocks(self.pool, self.spec, views[0].dtype, load.hashes, scatter)
            self.stats.load_blocks += got
            if got < n:  # failed verification, evicted, or the pool is gone: vLLM recomputes these
                self.stats.load_failed_blocks += n - got
                self._load_errors.update(load.page_ids[got * self.pages_per_block :])
        self.stats.load_s += time.perf_counter() - t0

    def wait_for_save(self, metadata: ConnectorMetadata) -> None:
        """Worker side: gather the pages of the blocks to save into canonical blocks and hand them to the
        background saver.
        """
        self.stats.steps += 1
        if not metadata.saves:
            return
        t0 = time.perf_counter()
        assert self._paged is not None, "register_kv_caches first"
        try:
            if self.tp_size == 1:
                paged, views = self._paged, self._views
                for save in metadata.saves:
                    pages = self._kernel_pages(save.page_ids)
                    per = len(pages) // len(save.hashes)

                    def gather(
                        first: int, count: int, out: torch.Tensor, pages: list[int] = pages, per: int = per
                    ) -> None:
                        gather_blocks(self.spec, paged, views, pages[first * per : (first + count) * per], out, count)

                    self._submit(save.hashes, gather)
                return
            self._save_tp(metadata)
        finally:
            self.stats.save_s += time.perf_counter() - t0

    def _submit(self, hashes: Sequence[bytes], write: Callable[[int, int, torch.Tensor], None]) -> None:
        """Gather the blocks of ``hashes`` with ``write`` straight into the put's arena slots,
        now (on the step), and leave the commit to the saver thread."""
        if self._saver is None:
            return
        dtype = self._views[0].dtype
        self._saver.submit(
            hashes,
            len(hashes) * self.spec.block_bytes,
            lambda: stage_blocks(self.pool, self.spec, dtype, hashes, write),
        )

    def _save_tp(self, metadata: ConnectorMetadata) -> None:
        assert self._paged is not None
        if self.head_allgather is None or self.tp_size > self.spec.num_kv_heads:
            raise InvalidArgument(
                f"saving from TP={self.tp_size} needs head_allgather and at most {self.spec.num_kv_heads} ranks",
                hint="pass head_allgather (the TP group's all_gather on dim 3), or save from a TP=1 instance",
            )
        local_spec = dataclasses.replace(self.spec, num_kv_heads=self._paged.num_kv_heads)
        local_layout = dataclasses.replace(self._paged, head_start=0)
        for save in metadata.saves:  # every rank must walk the same saves: the all-gather is collective
            n = len(save.hashes)
            local = self._buffer(n, local_spec)
            gather_blocks(local_spec, local_layout, self._views, self._kernel_pages(save.page_ids), local, n)
            full = self.head_allgather(local)
            if tuple(full.shape) != (n, *self.spec.block_shape):
                raise InvalidArgument(
                    f"head_allgather returned {tuple(full.shape)}, not [{n}, *{self.spec.block_shape}]"
                )
            if self.tp_rank == 0:  # one copy from the gathered heads (any device) into the slots

                def put_full(first: int, count: int, out: torch.Tensor, full: torch.Tensor = full) -> None:
                    out.copy_(full[first : first + count])

                self._submit(save.hashes, put_full)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def drain_saves(self, timeout_s: float = 30.0) -> bool:
        """Wait up to ``timeout_s`` for queued saves to be stored; True when none is left."""
        return self._saver.drain(timeout_s) if self._saver is not None else True

    def shutdown(self) -> None:
        """Stop the background saver after its queued puts."""
        if self._saver is not None:
            self._saver.stop()
            self._saver = None


_BUILT: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """``KvpoolConnector`` is built on first access (PEP 562) by subclassing the real
    ``KVConnectorBase_V1``, so importing this module never needs vLLM."""
    if name == "KvpoolConnector":
        if name not in _BUILT:
            from kvpool.connectors.vllm_engine import build_vllm_class

            _BUILT[name] = build_vllm_class()
        return _BUILT[name]
    raise AttributeError(name)
