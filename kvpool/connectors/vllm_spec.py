"""From vLLM's configuration to a pool namespace, or a refusal that says why.

``ConnectorOptions`` is the ``kv_connector_extra_config`` of ``--kv-transfer-config``,
validated (unknown keys are an error that lists the known ones). ``derive_spec`` reads the
model, parallel and cache configuration and the engine's ``KVCacheConfig`` and returns the
``KVSpec`` of the blocks this engine produces, or raises ``SpecMismatch`` for what kvpool
cannot serve exactly:

* MLA models, sliding-window, chunked-local and hybrid models (more than one KV cache
  group, or any group that is not plain full attention): a pool hit is a prefix of every
  token's K and V, and those caches do not hold every token's K and V;
* quantised caches with scales, padded pages, packed head slots;
* pipeline parallelism (a rank holds only some layers);
* a pool ``block_tokens`` that vLLM's block size does not divide.

The model revision in the namespace is, in order: the ``revision`` option, vLLM's
``--revision``, else a fingerprint of the weight files (xxh3-128 over every
``*.safetensors`` / ``*.bin`` / ``*.pt`` file's bytes under the model directory), so the
same model id with other weights never hits. ``load_format=dummy`` weights are random per
seed: the fingerprint is the seed. No vLLM import here (plain attribute reads).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import xxhash

from kvpool.core.auth import MAX_TOKEN_BYTES
from kvpool.core.errors import InvalidArgument, SpecMismatch
from kvpool.core.spec import KVSpec

log = logging.getLogger("kvpool.connectors.vllm")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
#: Read size for the weight fingerprint: big enough to run at disk speed.
FINGERPRINT_CHUNK_BYTES = 16 << 20
MAX_SALT_BYTES = 256


@dataclass(frozen=True)
class ConnectorOptions:
    """``kv_connector_extra_config`` keys (all optional)."""

    pool_address: str = "127.0.0.1:7450"
    salt: str = ""  # the tenant salt: engines with the same salt share blocks
    block_tokens: int = 0  # pool block size in tokens; 0 = vLLM's block size
    revision: str = ""  # pin the model revision in the namespace; "" = fingerprint the weights
    strict: bool = False  # refuse to start (instead of serving without the pool) on any problem
    timeout_ms: int = 2_000  # per pool call; a dead pool costs at most this once, then calls are skipped
    retry_interval_ms: int = 5_000  # while the pool is down, try again this often
    max_pending_save_bytes: int = 256 << 20  # saves queued for the background writer; past it, saves drop
    stats_path: str = ""  # write the connector's counters as JSON here at shutdown
    # the tenant's bearer token for a pool with credentials (docs/security.md); kept out of repr (logs)
    token: str = field(default="", repr=False)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorOptions:
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise InvalidArgument(
                f"unknown kvpool option(s) {unknown} in kv_connector_extra_config",
                hint=f"known options: {sorted(known)}",
            )
        values: dict[str, Any] = {}
        for name, value in extra.items():
            default = getattr(cls, name)
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise InvalidArgument(f"kvpool option {name} must be true or false, got {value!r}")
            elif isinstance(default, int):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidArgument(f"kvpool option {name} must be a non-negative integer, got {value!r}")
            elif not isinstance(value, str):
                raise InvalidArgument(f"kvpool option {name} must be a string, got {value!r}")
            values[name] = value
        opts = cls(**values)
        if len(opts.salt.encode()) > MAX_SALT_BYTES:
            raise InvalidArgument(f"kvpool salt is longer than {MAX_SALT_BYTES} bytes")
        if len(opts.token.encode()) > MAX_TOKEN_BYTES:
            raise InvalidArgument(f"kvpool token is longer than {MAX_TOKEN_BYTES} bytes")
        if opts.timeout_ms == 0 or opts.retry_interval_ms == 0:
            raise InvalidArgument("kvpool timeout_ms and retry_interval_ms must be positive")
        return opts


def weights_fingerprint(model_dir: Path) -> str:
    """xxh3-128 of every weight file's name, size and bytes under ``model_dir`` (sorted)."""
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        return ""
    h = xxhash.xxh3_128()
    for path in files:
        h.update(f"{path.relative_to(model_dir)}\0{path.stat().st_size}\0".encode())
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(FINGERPRINT_CHUNK_BYTES):
                h.update(chunk)
    return "w-" + h.hexdigest()


def model_revision(opts: ConnectorOptions, model_config: Any, load_config: Any) -> str:
    """The revision that goes into the namespace (see the module docstring for the order)."""
    if opts.revision:
        return opts.revision
    if getattr(model_config, "revision", None):
        return str(model_config.revision)
    load_format = str(getattr(load_config, "load_format", "auto"))
    if load_format.endswith("dummy"):
        return f"dummy-seed-{getattr(model_config, 'seed', 0)}"
    model = Path(str(model_config.model))
    fingerprint = weights_fingerprint(model) if model.is_dir() else ""
    if not fingerprint:
        raise SpecMismatch(
            f"cannot fingerprint the weights of {model_config.model!r} (no local weight files)",
            hint="pass --revision (a hub commit) or the kvpool option 'revision' naming these exact weights",
        )
    return fingerprint


def _torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def derive_spec(opts: ConnectorOptions, vllm_config: Any, kv_cache_config: Any) -> KVSpec:
    """The pool KVSpec of this engine, or ``SpecMismatch`` saying what is not supported."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if getattr(mc, "use_mla", False):
        raise SpecMismatch("MLA models are not supported by the kvpool vLLM connector yet")
    if getattr(pc, "pipeline_parallel_size", 1) != 1:
        raise SpecMismatch("pipeline parallelism is not supported by the kvpool vLLM connector")
    window = mc.get_sliding_window() if hasattr(mc, "get_sliding_window") else None
    if window:
        raise SpecMismatch(
            f"{mc.model} uses sliding-window attention (window {window}): its cache does not hold every "
            "token's KV, so a pool prefix cannot be served exactly",
            hint="run this model without the kvpool connector",
        )
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise SpecMismatch(
            f"{mc.model} has {len(groups)} KV cache groups ({', '.join(kinds)}): hybrid models are not supported",
            hint="run this model without the kvpool connector",
        )
    gspec = groups[0].kv_cache_spec
    name = type(gspec).__name__
    plain = (
        name == "FullAttentionSpec"
        and getattr(gspec, "sliding_window", None) is None
        and getattr(gspec, "attention_chunk_size", None) is None
        and not getattr(gspec, "non_causal", False)
        and getattr(gspec, "page_size_padded", None) is None
        and getattr(gspec, "num_head_slots", None) is None
        and getattr(gspec, "state_content_bytes", None) is None
        and getattr(gspec, "tokens_per_state", 1) == 1
        and getattr(gspec, "head_size_v", gspec.head_size) == gspec.head_size
        and getattr(getattr(gspec, "kv_quant_mode", None), "name", "NONE") == "NONE"
    )
    if not plain:
        raise SpecMismatch(
            f"{mc.model}'s KV cache ({gspec}) is not plain full attention with dense K and V",
            hint="kvpool serves full-attention models with unquantised (or plain fp8) K/V caches only",
        )
    page = int(cc.block_size)
    block_tokens = opts.block_tokens or page
    if block_tokens % page:
        raise SpecMismatch(
            f"pool block_tokens {block_tokens} is not a multiple of vLLM's block size {page}",
            hint=f"set the kvpool option block_tokens to a multiple of {page} (e.g. {page}), or --block-size",
        )
    dtype = _torch_dtype_name(gspec.dtype)
    try:
        return KVSpec(
            model=str(mc.model),
            revision=model_revision(opts, mc, vllm_config.load_config),
            num_layers=int(mc.get_num_layers(pc)),
            num_kv_heads=int(mc.get_total_num_kv_heads()),
            head_dim=int(gspec.head_size),
            dtype=dtype,
            block_tokens=block_tokens,
        )
    except InvalidArgument as err:
        raise SpecMismatch(f"{mc.model}: {err.message}", hint=err.hint) from None
