"""The class vLLM loads, ``KvpoolConnector``: vLLM's objects in, ``VllmPoolConnectorLogic`` calls out.

Built by subclassing the real ``KVConnectorBase_V1`` on first use (needs vLLM installed);
everything that decides or moves bytes is in ``kvpool.connectors.vllm`` and is tested
without vLLM, and this glue is tested inside real vLLM engines (tests/vllm/).

Requests the pool cannot serve exactly are passed through untouched (no lookup, no save):
multimodal prompts (their placeholder token ids do not name the image), LoRA requests (the
adapter is not in this engine's namespace), prompt embeddings, requests with a
``cache_salt`` (vLLM's own per-request cache isolation) and those that ask to be
(``kv_transfer_params`` ``{"kvpool": "skip"}``). A configuration kvpool cannot
serve, or a pool that is not running, disables the connector with one log line unless the
option ``strict`` is set (then the engine refuses to start).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any, cast

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # type: ignore[import-not-found]

from kvpool.connectors.resilient_pool import ResilientPool
from kvpool.connectors.vllm import ConnectorMetadata, VllmPoolConnectorLogic
from kvpool.connectors.vllm_spec import ConnectorOptions, derive_spec
from kvpool.core.clock import MonotonicClock
from kvpool.core.errors import InvalidArgument, KVPoolError, Unavailable
from kvpool.core.spec import KVSpec, Namespace

log = logging.getLogger("kvpool.connectors.vllm")

STATS_INTERVAL_S = 1.0
#: A request's ``kv_transfer_params`` that keep it off the pool (no lookup, no load, no save):
#: a prompt that must not be stored, or a benchmark's control of the same engine
#: (``SamplingParams(extra_args={"kv_transfer_params": SKIP_PARAMS})``, or the OpenAI
#: server's ``"kv_transfer_params"`` field).
SKIP_PARAMS: dict[str, Any] = {"kvpool": "skip"}
#: the other value of that key: the default, said explicitly
USE_PARAMS: dict[str, Any] = {"kvpool": "use"}
#: how the reason for a request whose ``"kvpool"`` value is neither starts (logged once per value)
UNKNOWN_PARAMS_REASON = "unknown kv_transfer_params"


def _passthrough_reason(request: Any) -> str:
    """Why a request must not use the pool ("" when it may). A ``"kvpool"`` value other than
    "skip" or "use" (a typo of "skip", most likely) is passed through too: a prompt its
    sender meant to keep out of the pool is never stored by mistake."""
    params = getattr(request, "kv_transfer_params", None)
    if isinstance(params, dict) and "kvpool" in params:
        value = params["kvpool"]
        if value == SKIP_PARAMS["kvpool"]:
            return "skipped by the request"
        if value != USE_PARAMS["kvpool"]:
            return f"{UNKNOWN_PARAMS_REASON} {{'kvpool': {value!r}}} (known: 'skip', 'use')"
    if getattr(request, "mm_features", None):
        return "multimodal"
    if getattr(request, "lora_request", None) is not None:
        return "lora"
    if getattr(request, "prompt_embeds", None) is not None or not getattr(request, "prompt_token_ids", None):
        return "prompt embeddings"
    if getattr(request, "cache_salt", None):
        return "cache_salt"
    return ""


def _backend_name(vllm_config: Any, layer_names: list[str]) -> str:
    """The one attention backend of these layers, from vLLM's static forward context."""
    context = vllm_config.compilation_config.static_forward_context
    names = set()
    for name in layer_names:
        backend = getattr(context.get(name), "attn_backend", None)
        names.add(backend.get_name() if backend is not None else "unknown")
    if len(names) != 1:
        raise InvalidArgument(f"the KV cache layers use several attention backends: {sorted(names)}")
    return names.pop()


class _Meta(ConnectorMetadata, KVConnectorMetadata):  # type: ignore[misc]
    pass


class KvpoolConnector(KVConnectorBase_V1):  # type: ignore[misc]
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._logic: VllmPoolConnectorLogic | None = None
        self._pool: ResilientPool | None = None
        self._registered = False
        self._prompts: dict[str, tuple[list[int], list[int]]] = {}  # req id -> (prompt, block table)
        self._passthrough: set[str] = set()
        self._warned_params: set[str] = set()  # unknown kv_transfer_params already logged
        self._stats_due_s = 0.0
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._strict = extra.get("strict") is True
        self._opts = ConnectorOptions()
        try:
            self._opts = ConnectorOptions.from_extra(extra)
            spec = derive_spec(self._opts, vllm_config, kv_cache_config)
            self._start(vllm_config, role, spec)
        except KVPoolError as err:
            self._disable(err)

    def _start(self, vllm_config: Any, role: Any, spec: KVSpec) -> None:
        from kvpool.client import PoolClient

        opts = self._opts
        salt = opts.salt.encode()
        timeout_s = opts.timeout_ms / 1000.0
        pool = ResilientPool(
            lambda: PoolClient.connect(opts.pool_address, spec, salt=salt, timeout_s=timeout_s, token=opts.token),
            Namespace(spec, salt),
            MonotonicClock(),
            opts.retry_interval_ms,
            opts.pool_address,
        )
        if not pool.try_connect() and self._strict:
            raise Unavailable(f"the pool at {opts.pool_address} is not reachable", hint="start 'kvpool serve'")
        pc = vllm_config.parallel_config
        tp_size, rank, allgather = pc.tensor_parallel_size, 0, None
        if role == KVConnectorRole.WORKER and tp_size > 1:
            from vllm.distributed import get_tp_group  # type: ignore[import-not-found]

            group = get_tp_group()
            rank = group.rank_in_group

            def allgather(t: torch.Tensor) -> torch.Tensor:
                return group.all_gather(t.to(group.device), dim=3)  # type: ignore[no-any-return]

        if getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning(
                "kvpool: kv_load_failure_policy is %r: a pool block that fails its checksum or vanishes "
                'fails its request instead of being recomputed; set "kv_load_failure_policy": "recompute" '
                "in --kv-transfer-config",
                vllm_config.kv_transfer_config.kv_load_failure_policy,
            )
        page = int(vllm_config.cache_config.block_size)
        self._pool = pool
        self._logic = VllmPoolConnectorLogic(spec, pool, page, rank, tp_size, allgather, opts.max_pending_save_bytes)
        log.info(
            "kvpool: %s connector on %s, namespace %s (%s)",
            self._role_name,
            opts.pool_address,
            Namespace(spec, salt).digest().hex()[:16],
            spec.describe(),
        )

    def _disable(self, err: KVPoolError) -> None:
        hint = f" ({err.hint})" if err.hint else ""
        if self._strict:
            raise err
        log.error("kvpool: connector disabled, vLLM serves without the pool: %s%s", err.message, hint)
        self._logic = None

    # -- scheduler side ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if self._logic is None:
            return 0, False
        reason = _passthrough_reason(request)
        if reason:
            if reason.startswith(UNKNOWN_PARAMS_REASON) and reason not in self._warned_params:
                self._warned_params.add(reason)
                log.warning("kvpool: %s: request %s and the like pass the pool by", reason, request.request_id)
            self._passthrough.add(request.request_id)
            return 0, False
        try:
            return self._logic.get_num_new_matched_tokens(
                request.request_id, request.prompt_token_ids, num_computed_tokens
            )
        except KVPoolError as err:  # not an outage (those are misses): e.g. a revoked token
            log.error("kvpool: connector disabled, vLLM serves without the pool: %s", err)
            self._logic = None
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._logic is None or num_external_tokens <= 0:
            return
        self._logic.update_state_after_alloc(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        if self._logic is None:
            return _Meta()
        logic, saves = self._logic, []
        for req in scheduler_output.scheduled_new_reqs:
            if req.req_id in self._passthrough or not req.prompt_token_ids:
                continue
            self._prompts[req.req_id] = (list(req.prompt_token_ids), list(req.block_ids[0]))
            plan = logic.plan_save(
                req.req_id,
                req.prompt_token_ids,
                req.block_ids[0],
                req.num_computed_tokens,
                scheduler_output.num_scheduled_tokens[req.req_id],
            )
            if plan is not None:
                saves.append(plan)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._prompts:
                continue
            prompt, table = self._prompts[req_id]
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed and new_blocks is not None:
                table[:] = new_blocks[0]  # a resumed request gets its whole block table again
            elif new_blocks is not None:
                table.extend(new_blocks[0])
            if cached.num_computed_tokens[i] >= len(prompt):
                continue  # decoding: nothing of the prompt left to save
            plan = logic.plan_save(
                req_id, prompt, table, cached.num_computed_tokens[i], scheduler_output.num_scheduled_tokens[req_id]
            )
            if plan is not None:
                saves.append(plan)
        meta = logic.build_connector_meta(saves)
        self._write_stats()
        return _Meta(loads=meta.loads, saves=meta.saves)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._prompts.pop(request.request_id, None)
        self._passthrough.discard(request.request_id)
        if self._logic is None:
            return False, None
        return self._logic.request_finished(request.request_id)

    # -- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._logic is None:
            return
        try:
            backend = _backend_name(self._vllm_config, list(kv_caches))
            layout = self._logic.register_kv_caches(kv_caches, backend, int(self._kv_cache_config.num_blocks))
            self._registered = True
            log.info("kvpool: vLLM cache layout %s", layout)
        except KVPoolError as err:
            self._disable(err)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._logic is None or not self._registered:
            return
        try:
            self._logic.start_load_kv(cast(ConnectorMetadata, meta))
        except Exception:  # a bug of ours must not take the engine down: recompute, stop using the pool
            self._fail_worker("a load")

    def _fail_worker(self, what: str) -> None:
        """Stop moving bytes on this worker after an unexpected error; every block this step
        was to load is reported as a load error, so vLLM recomputes it (never wrong KV)."""
        log.exception("kvpool: %s failed unexpectedly; this worker stops using the pool", what)
        self._registered = False

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole blocks are gathered after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        if self._logic is None or not self._registered:
            return
        try:
            self._logic.wait_for_save(cast(ConnectorMetadata, self._get_connector_metadata()))
        except Exception:  # a lost save is a future miss, never an engine error
            self._fail_worker("a save")
        self._write_stats()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        meta = self._connector_metadata
        if (self._logic is None or not self._registered) and isinstance(meta, ConnectorMetadata):
            # the scheduler offered blocks this worker cannot load: vLLM must recompute them
            return {p for load in meta.loads for p in load.page_ids}
        return self._logic.get_block_ids_with_load_errors() if self._logic is not None else set()

    def _write_stats(self, force: bool = False) -> None:
        """The counters as JSON at ``stats_path``.<role>.json: at most once a second (the
        engine may never call ``shutdown`` on the scheduler side) and at shutdown."""
        logic = self._logic
        now = time.monotonic()
        if logic is None or not self._opts.stats_path or (not force and now < self._stats_due_s):
            return
        self._stats_due_s = now + STATS_INTERVAL_S
        pool = self._pool
        extra = {"outages": pool.outages if pool else 0, "role": self._role_name}
        path = f"{self._opts.stats_path}.{self._role_name}.json"
        with open(path + ".tmp", "w") as f:
            json.dump({**dataclasses.asdict(logic.stats), **extra}, f)
        os.replace(path + ".tmp", path)

    def shutdown(self) -> None:
        self._write_stats(force=True)
        logic, self._logic = self._logic, None
        if logic is None:
            return
        logic.shutdown()
        if self._pool is not None:
            self._pool.close()


def build_vllm_class() -> type:
    """The connector class (kept for ``kvpool.connectors.vllm.__getattr__``)."""
    return KvpoolConnector
