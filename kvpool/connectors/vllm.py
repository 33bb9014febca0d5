"""vLLM ``KVConnectorBase_V1`` adapter: vLLM's paged KV <-> the pool's canonical blocks.

The logic lives in ``VllmPoolConnectorLogic`` (no vLLM import, unit-tested here); the
class vLLM loads, ``KvpoolConnector``, is built on first attribute access (PEP 562
``__getattr__``) by subclassing the real ``KVConnectorBase_V1``, so importing this module
never needs vLLM. Configure vLLM with::

    --kv-transfer-config '{"kv_connector": "KvpoolConnector", "kv_role": "kv_both",
      "kv_connector_module_path": "kvpool.connectors.vllm",
      "kv_connector_extra_config": {"pool_address": "127.0.0.1:7450", "salt": "tenant-a", "block_tokens": 64}}'

Scheduler side: ``get_num_new_matched_tokens`` hashes the prompt in the pool namespace and
asks the pool for its longest cached prefix (whole pool blocks, never the last prompt
token); ``update_state_after_alloc`` records which engine pages those blocks go to;
``build_connector_meta`` hands the loads and the saves (prompt blocks completed this step)
to the workers; ``request_finished`` returns False (saves are synchronous, pages may be
freed at once).

Worker side: ``register_kv_caches`` takes vLLM's per-layer ``[2, num_blocks, block_size,
kv_heads, head_size]`` tensors (FlashAttention NHD layout); ``start_load_kv`` reads blocks
from the pool and scatters them into the pages; a block that fails verification is not
scattered and its engine block ids are reported by ``get_block_ids_with_load_errors`` so
vLLM recomputes them; ``wait_for_save`` gathers completed blocks and puts them.

What was verified against a live vLLM: nothing (vLLM is not installable here). See
docs/engine.md for the exact list.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpool.connectors.pool_api import BlockPool
from kvpool.core.errors import InvalidArgument
from kvpool.core.spec import KVSpec
from kvpool.kernels.paged import PagedLayout, gather_blocks, scatter_blocks

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class BlockTransfer:
    """Pool blocks [first_block, first_block + len(hashes)) of a request and their engine pages."""

    request_id: str
    hashes: tuple[bytes, ...]
    page_ids: tuple[int, ...]  # engine block ids covering exactly these pool blocks, in order


@dataclass
class ConnectorMetadata:
    """Scheduler -> worker, once per step (vLLM pickles it; plain fields only)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


def pages_for_blocks(block_ids: Sequence[int], first_block: int, num_blocks: int, pages_per_block: int) -> list[int]:
    """Engine pages of pool blocks [first_block, first_block + num_blocks) from a request's block table."""
    start, end = first_block * pages_per_block, (first_block + num_blocks) * pages_per_block
    if end > len(block_ids):
        raise InvalidArgument(f"block table has {len(block_ids)} pages, {end} needed for pool blocks up to {end}")
    return list(block_ids[start:end])


def layer_order(names: Sequence[str]) -> list[str]:
    """vLLM layer names (``model.layers.12.self_attn.attn``) sorted by their layer index."""

    def index(name: str) -> int:
        m = _LAYER_INDEX.search("." + name + ".")
        if m is None:
            raise InvalidArgument(f"cannot find a layer index in {name!r}")
        return int(m.group(1))

    return sorted(names, key=index)


class VllmPoolConnectorLogic:
    """Both sides of the connector without vLLM: requests are passed in as plain values."""

    def __init__(
        self,
        spec: KVSpec,
        pool: BlockPool,
        page_tokens: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        head_allgather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """``head_allgather`` (needed to save with TP > 1): concatenates every TP rank's
        ``[n, layers, kv, local_heads, tokens, dim]`` tensor along dim 3 in rank order, e.g.
        vLLM's ``get_tp_group().all_gather(t, dim=3)``. Rank 0 then puts whole blocks."""
        from kvpool.kernels.paged import tp_head_range

        if spec.block_tokens % page_tokens:
            raise InvalidArgument(
                f"pool block_tokens {spec.block_tokens} must be a multiple of vLLM block_size {page_tokens}"
            )
        self.spec = spec
        self.pool = pool
        self.page_tokens = page_tokens
        self.pages_per_block = spec.block_tokens // page_tokens
        self.tp_rank, self.tp_size = tp_rank, tp_size
        head_start, heads = tp_head_range(spec.num_kv_heads, tp_size, tp_rank)
        self.layout = PagedLayout(page_tokens, heads, spec.head_dim, "NHD", head_start)
        self.head_allgather = head_allgather
        # scheduler side
        self._hashes: dict[str, list[bytes]] = {}
        self._pending_loads: list[BlockTransfer] = []
        self._saved_blocks: dict[str, int] = {}
        # worker side
        self._kv_caches: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        self.metadata: ConnectorMetadata | None = None

    # -- scheduler side -------------------------------------------------------------------
    def request_hashes(self, request_id: str, token_ids: Sequence[int]) -> list[bytes]:
        if request_id not in self._hashes:
            self._hashes[request_id] = self.pool.hashes(list(token_ids))
        return self._hashes[request_id]

    def get_num_new_matched_tokens(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(tokens the pool adds beyond vLLM's own prefix cache, load asynchronously?)."""
        if num_computed_tokens % self.spec.block_tokens:
            # vLLM's own prefix hit ends inside a pool block: loading that block would rewrite
            # pages vLLM already holds (and may share with running requests). Load nothing.
            return 0, False
        hashes = self.request_hashes(request_id, token_ids)
        usable = (len(token_ids) - 1) // self.spec.block_tokens
        hit_tokens = self.pool.lookup(hashes[:usable]) * self.spec.block_tokens if usable else 0
        return max(0, hit_tokens - num_computed_tokens), False

    def update_state_after_alloc(
        self, request_id: str, block_ids: Sequence[int], num_computed_tokens: int, num_external_tokens: int
    ) -> None:
        """Record the load of the pool blocks covering the external tokens into their pages."""
        if num_external_tokens <= 0:
            return
        t = self.spec.block_tokens
        if num_computed_tokens % t or num_external_tokens % t:
            raise InvalidArgument("external tokens must start and end on pool block boundaries")
        first, count = num_computed_tokens // t, num_external_tokens // t
        hashes = self._hashes[request_id][first : first + count]
        pages = pages_for_blocks(block_ids, first, count, self.pages_per_block)
        self._pending_loads.append(BlockTransfer(request_id, tuple(hashes), tuple(pages)))
        self._saved_blocks[request_id] = max(self._saved_blocks.get(request_id, 0), first + count)

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
        meta = ConnectorMetadata(loads=self._pending_loads, saves=list(saves))
        self._pending_loads = []
        return meta

    def request_finished(self, request_id: str) -> tuple[bool, dict[str, Any] | None]:
        self._hashes.pop(request_id, None)
        self._saved_blocks.pop(request_id, None)
        return False, None

    # -- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ordered = [kv_caches[name] for name in layer_order(list(kv_caches))]
        from kvpool.kernels.paged import check_caches

        check_caches(self.spec, self.layout, ordered)  # refuse another layout/dtype/heads up front
        self._kv_caches = ordered

    def _buffer(self, n: int) -> torch.Tensor:
        return torch.empty(n, *self.spec.block_shape, dtype=self._kv_caches[0].dtype)  # fully overwritten

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        for load in metadata.loads:
            n = len(load.hashes)
            buf = self._buffer(n)
            got = self.pool.get_into(list(load.hashes), buf)
            if got:
                scatter_blocks(self.spec, self.layout, buf, self._kv_caches, list(load.page_ids), got)
            if got < n:  # verification failed or the block vanished: vLLM must recompute these pages
                self._load_errors.update(load.page_ids[got * self.pages_per_block :])

    def wait_for_save(self, metadata: ConnectorMetadata) -> None:
        if self.tp_size == 1:
            for save in metadata.saves:
                n = len(save.hashes)
                buf = self._buffer(n)
                gather_blocks(self.spec, self.layout, self._kv_caches, list(save.page_ids), buf, n)
                self.pool.put(list(save.hashes), buf)
            return
        if self.head_allgather is None or self.tp_size > self.spec.num_kv_heads:
            raise InvalidArgument(
                f"saving from TP={self.tp_size} needs head_allgather and at most {self.spec.num_kv_heads} ranks",
                hint="pass head_allgather (the TP group's all_gather on dim 3), or save from a TP=1 instance",
            )
        local_spec = dataclasses.replace(self.spec, num_kv_heads=self.layout.num_kv_heads)
        local_layout = dataclasses.replace(self.layout, head_start=0)
        for save in metadata.saves:  # every rank must walk the same saves: the all-gather is collective
            n = len(save.hashes)
            local = torch.empty(n, *local_spec.block_shape, dtype=self._kv_caches[0].dtype)
            gather_blocks(local_spec, local_layout, self._kv_caches, list(save.page_ids), local, n)
            full = self.head_allgather(local)
            if tuple(full.shape) != (n, *self.spec.block_shape):
                raise InvalidArgument(
                    f"head_allgather returned {tuple(full.shape)}, not [{n}, *{self.spec.block_shape}]"
                )
            if self.tp_rank == 0:
                self.pool.put(list(save.hashes), full.cpu().contiguous())

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


def _build_vllm_class() -> type:
    """Subclass the real KVConnectorBase_V1 (needs vLLM installed). Unverified against a live vLLM."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    class _Meta(ConnectorMetadata, KVConnectorMetadata):  # type: ignore[misc]
        pass

    class KvpoolConnector(KVConnectorBase_V1):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            from kvpool.client import PoolClient

            extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
            mc, pc = vllm_config.model_config, vllm_config.parallel_config
            page = vllm_config.cache_config.block_size
            spec = KVSpec(
                model=mc.model,
                revision=str(getattr(mc, "revision", "") or ""),
                num_layers=mc.get_num_layers(pc),
                num_kv_heads=mc.get_total_num_kv_heads(),
                head_dim=mc.get_head_size(),
                dtype=str(mc.dtype).removeprefix("torch."),
                block_tokens=int(extra.get("block_tokens", page)),
            )
            client = PoolClient.connect(extra["pool_address"], spec, salt=str(extra.get("salt", "")).encode())
            tp_size = pc.tensor_parallel_size
            rank, allgather = 0, None
            if role == KVConnectorRole.WORKER and tp_size > 1:
                from vllm.distributed import get_tp_group  # type: ignore[import-not-found]

                group = get_tp_group()
                rank = group.rank_in_group

                def allgather(t: torch.Tensor) -> torch.Tensor:
                    return group.all_gather(t.to(group.device), dim=3)  # type: ignore[no-any-return]

            self._logic = VllmPoolConnectorLogic(spec, client, page, rank, tp_size, allgather)
            self._prompts: dict[str, tuple[list[int], list[int]]] = {}  # req id -> (prompt, block table)

        # scheduler side
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return self._logic.get_num_new_matched_tokens(
                request.request_id, request.prompt_token_ids, num_computed_tokens
            )

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            block_ids = blocks.get_block_ids()[0] if num_external_tokens else []
            self._logic.update_state_after_alloc(
                request.request_id, block_ids, request.num_computed_tokens, num_external_tokens
            )

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            saves = []
            for req in scheduler_output.scheduled_new_reqs:
                self._prompts[req.req_id] = (list(req.prompt_token_ids), list(req.block_ids[0]))
                plan = self._logic.plan_save(
                    req.req_id,
                    req.prompt_token_ids,
                    req.block_ids[0],
                    req.num_computed_tokens,
                    scheduler_output.num_scheduled_tokens[req.req_id],
                )
                if plan is not None:
                    saves.append(plan)
            cached: Any = getattr(scheduler_output, "scheduled_cached_reqs", None)
            for i, req_id in enumerate(getattr(cached, "req_ids", None) or []):
                if req_id not in self._prompts:
                    continue
                prompt, table = self._prompts[req_id]
                new_blocks = cached.new_block_ids[i]
                if new_blocks is not None:
                    table.extend(new_blocks[0])
                if cached.num_computed_tokens[i] >= len(prompt):
                    continue  # decoding: nothing of the prompt left to save
                plan = self._logic.plan_save(
                    req_id, prompt, table, cached.num_computed_tokens[i], scheduler_output.num_scheduled_tokens[req_id]
                )
                if plan is not None:
                    saves.append(plan)
            meta = self._logic.build_connector_meta(saves)
            return _Meta(loads=meta.loads, saves=meta.saves)

        def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
            self._prompts.pop(request.request_id, None)
            return self._logic.request_finished(request.request_id)

        # worker side
        def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
            self._logic.register_kv_caches(kv_caches)

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            self._logic.start_load_kv(self._get_connector_metadata())

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None  # loads are synchronous in start_load_kv

        def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
            return None  # whole blocks are gathered after the forward, in wait_for_save

        def wait_for_save(self) -> None:
            self._logic.wait_for_save(self._get_connector_metadata())

        def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
            return None, None

        def get_block_ids_with_load_errors(self) -> set[int]:
            return self._logic.get_block_ids_with_load_errors()

    return KvpoolConnector


_BUILT: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name == "KvpoolConnector":
        if name not in _BUILT:
            _BUILT[name] = _build_vllm_class()
        return _BUILT[name]
    raise AttributeError(name)
