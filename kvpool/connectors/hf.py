"""Hugging Face transformers connector: prefill only the tokens the pool does not hold.

For a decoder-only causal LM on transformers 5.x (``DynamicCache`` with
``cache.layers[i].keys/values`` of shape ``[batch, kv_heads, tokens, head_dim]``):

1. hash the prompt's full blocks in the pool's namespace and find the longest cached prefix
   (at most ``len(prompt) - 1`` tokens, so the last token always runs and yields logits);
2. read those blocks (checksummed by the pool; a bad block truncates the hit and the rest is
   recomputed) and build a ``DynamicCache`` from them: a CPU model copies them straight from
   the leased arena into the cache's per-layer K/V tensors, a GPU model through one pinned
   host buffer and one host-to-device copy;
3. run the model on the missed suffix only;
4. store the prompt's new full blocks back, written from the cache straight into the put's
   arena slots (the pool skips ones it already has).

What makes a hit exact (issue 11):

* The spec is read from the cache the model really produces (``probe_cache_layout``: one
  2-token forward, once per model), not from config attribute names: MQA (Falcon
  ``multi_query``), GQA, ``head_dim != hidden / heads`` (Gemma, Qwen3) and layer counts come
  out right by construction.
* Sliding-window and hybrid (sliding + full) models: transformers' sliding layers keep only
  the last ``window - 1`` tokens, so slicing them as if they held the prompt stored wrong KV.
  The connector runs every model with a cache of full layers (``DynamicCache()`` without a
  config): every layer keeps every token's K/V, and the attention mask, which transformers
  builds from the config and not from the cache, still limits each sliding layer to its window.
  The KV of token ``i`` depends only on tokens ``<= i`` for both layer kinds, so every stored
  block is the prompt's exact KV and every hit is exactly reusable. Cost: the engine-side cache
  of a sliding layer holds the whole prompt instead of the window.
* Models whose cache is anything else (chunked attention, linear attention / SSM states, KV
  shared across layers, encoder-decoder caches, K and V of different widths) are refused with
  ``UnsupportedModel`` before any prompt runs.
* The weights: unless the caller pins a revision, the spec revision is a fingerprint of the
  weights' bytes and of the config (``kvpool.connectors.fingerprint``), so the same model id
  with other weights never hits.
* One prompt per call: ``prefill`` refuses ``input_ids`` with more than one row up front (it
  used to flatten them into one prompt); ``prefill_batch`` runs several prompts, one at a time.

The model's spec must equal the pool namespace's spec: a mismatch is refused before a byte is
copied, naming both specs. ``close()`` removes the connector's forward hook.
"""

from __future__ import annotations

import inspect
import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvpool.connectors.fingerprint import is_fingerprint, module_fingerprint
from kvpool.connectors.paged_io import load_blocks, stage_blocks
from kvpool.connectors.pool_api import BlockPool, pool_spec
from kvpool.core.errors import InternalError, InvalidArgument, UnsupportedModel
from kvpool.core.spec import KVSpec
from kvpool.kernels.paged import blocks_to_tokens

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

#: transformers layer types whose KV of token i depends only on tokens <= i and that a cache of
#: full layers plus the config-built mask reproduces exactly (tested per architecture).
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")

#: Tokens of the probe forward (``probe_cache_layout``).
PROBE_TOKENS = 2

#: Config keys that do not change a single KV byte (bookkeeping, output switches, labels,
#: initialisation: the weights are hashed themselves). Everything else goes into the fingerprint.
CONFIG_KEYS_NOT_IN_KV = frozenset(
    {
        "_name_or_path", "_commit_hash", "transformers_version", "architectures", "dtype", "torch_dtype",
        "use_cache", "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id",
        "problem_type", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
    }
)  # fmt: skip


@dataclass(frozen=True)
class CacheLayout:
    """What a model's KV cache really holds, read from a probe forward."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    #: per layer: None for full attention, else the sliding window in tokens
    sliding_windows: tuple[int | None, ...]

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers keep less than every token's KV (sliding window): such a model is handled exactly
        or refused.
        """
        kinds = {w is None for w in self.sliding_windows}
        return len(kinds) == 2


_LAYOUTS: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], CacheLayout]] = weakref.WeakKeyDictionary()
_LAYOUTS_LOCK = threading.Lock()


def _refuse(model: Any, why: str) -> UnsupportedModel:
    return UnsupportedModel(
        f"{type(model).__name__}: {why}; the pool cannot hold its KV exactly",
        hint="serve this model without the kvpool connector (recompute every prompt)",
    )


def _check_config(model: Any) -> None:
    """Refuse, from the config alone, cache kinds the connector cannot hold exactly."""
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        raise _refuse(model, "encoder-decoder models keep cross-attention caches")
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    layer_types = getattr(text, "layer_types", None) or ()
    other = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if other:
        raise _refuse(model, f"layer types {other} (supported: {list(SUPPORTED_LAYER_TYPES)})")
    if getattr(text, "attention_chunk_size", None) is not None:
        raise _refuse(model, "chunked attention (attention_chunk_size) is not supported")
    if getattr(text, "kv_sharing_modes", None) or getattr(text, "num_kv_shared_layers", 0):
        raise _refuse(model, "layers that share another layer's KV are not supported")


def forward_with_cache(model: Any, ids: torch.Tensor, cache: Any) -> Any:
    """``model(ids)`` continuing ``cache``: the keyword is ``past_key_values`` up to transformers
    5.19 (the range vLLM 0.32 needs) and ``cache`` in later releases; take what the forward names."""
    params = inspect.signature(model.forward).parameters
    key = "cache" if "cache" in params else "past_key_values"
    return model(ids, use_cache=True, **{key: cache})


def output_cache(out: Any) -> Any:
    """The cache a forward returned (``past_key_values`` or, in later transformers, ``cache``)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def probe_cache_layout(model: Any) -> CacheLayout:
    """Run ``PROBE_TOKENS`` tokens through the model once and read the cache it builds.

    Why a forward and not config attributes: each architecture names and derives heads and
    head_dim differently (Falcon ``multi_query`` / ``new_decoder_architecture``, Gemma's
    ``head_dim``), and the cache layer objects are the ground truth of what the pool must hold.
    Cached per model object, and probed again when its parameter dtypes, device or config
    change (``model.to(torch.bfloat16)`` changes the KV dtype); refused kinds raise
    ``UnsupportedModel``.
    """
    params = list(model.parameters())
    key = (tuple(sorted({str(p.dtype) for p in params})), str(params[0].device), config_encoding(model.config))
    with _LAYOUTS_LOCK:
        known = _LAYOUTS.get(model)
    if known is not None and known[0] == key:
        return known[1]
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    _check_config(model)
    ids = torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device=params[0].device)
    with torch.no_grad():
        out = forward_with_cache(model, ids, DynamicCache(config=model.config))
    cache = output_cache(out)
    layers = getattr(cache, "layers", None)
    if not layers:
        raise _refuse(model, f"its forward returned no per-layer cache ({type(cache).__name__})")
    shapes: set[tuple[int, ...]] = set()
    dtypes: set[torch.dtype] = set()
    windows: list[int | None] = []
    for i, layer in enumerate(layers):
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            raise _refuse(model, f"cache layer {i} is a {type(layer).__name__}")
        keys, values = layer.keys, layer.values
        if keys is None or values is None or tuple(keys.shape) != tuple(values.shape):
            shape_k = None if keys is None else tuple(keys.shape)
            shape_v = None if values is None else tuple(values.shape)
            raise _refuse(model, f"cache layer {i} holds K {shape_k} and V {shape_v} (need equal shapes)")
        if keys.dim() != 4 or keys.shape[0] != 1 or keys.shape[2] != PROBE_TOKENS:
            raise _refuse(model, f"cache layer {i} holds {tuple(keys.shape)} for {PROBE_TOKENS} tokens")
        shapes.add((keys.shape[1], keys.shape[3]))
        dtypes.add(keys.dtype)
        windows.append(int(layer.sliding_window) if isinstance(layer, DynamicSlidingWindowLayer) else None)
    if len(shapes) != 1 or len(dtypes) != 1:
        raise _refuse(
            model, f"layers differ in (kv_heads, head_dim) {sorted(shapes)} or dtype {sorted(map(str, dtypes))}"
        )
    (heads, head_dim), dtype = shapes.pop(), dtypes.pop()
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise InvalidArgument(f"KV dtype {dtype} has no pool dtype", hint="use float32/float16/bfloat16")
    layout = CacheLayout(len(layers), int(heads), int(head_dim), name, tuple(windows))
    with _LAYOUTS_LOCK:
        _LAYOUTS[model] = (key, layout)
    return layout


def config_encoding(config: Any) -> bytes:
    """Canonical bytes of the config fields that can change KV (``CONFIG_KEYS_NOT_IN_KV`` left out)."""
    fields = {k: v for k, v in config.to_dict().items() if k not in CONFIG_KEYS_NOT_IN_KV}
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str).encode()


def weights_revision(model: Any, *, refresh: bool = False) -> str:
    """The fingerprint revision of a transformers model: its weights' bytes + ``config_encoding``."""
    return module_fingerprint(model, config_encoding(model.config), refresh=refresh)


def spec_for_model(model: Any, *, model_id: str, block_tokens: int, revision: str | None = None) -> KVSpec:
    """The KVSpec of a transformers causal LM, from the cache it really produces.

    ``revision=None`` (default): the weights' fingerprint (``weights_revision``). A non-empty
    string pins the revision instead: pin only a name of these exact weights (e.g. a hub commit
    hash), since a pin is trusted as given. Unsupported models raise ``UnsupportedModel``.
    """
    if revision == "":
        raise InvalidArgument(
            "an empty revision names no weights",
            hint="pass revision=None to fingerprint the weights, or a revision that names these exact weights",
        )
    layout = probe_cache_layout(model)
    return KVSpec(
        model=model_id,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        block_tokens=block_tokens,
        revision=weights_revision(model) if revision is None else revision,
    )


def _one_prompt(input_ids: Any) -> torch.Tensor:
    """``input_ids`` as one 1-D prompt; more than one row is refused (never flattened)."""
    ids = torch.as_tensor(input_ids)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InvalidArgument(f"token ids must be integers, got {ids.dtype}")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise InvalidArgument(
            f"input_ids of shape {tuple(ids.shape)}: prefill takes one prompt ([tokens] or [1, tokens])",
            hint="use prefill_batch(prompts) for several prompts: each runs and hits on its own",
        )
    return ids


@dataclass(frozen=True)
class PrefillResult:
    """What one prefill did. ``logits`` covers only the tokens that ran: ``[1, tokens_run, vocab]``.

    ``cache`` holds full layers (every token, sliding layers too): decode can continue on it.
    """

    logits: torch.Tensor
    cache: Any
    prompt_tokens: int
    hit_tokens: int
    tokens_run: int
    stored_blocks: int


class HFConnector:
    """Prefix reuse for one transformers model against one pool namespace.

    Use as a context manager, or call ``close()``: it removes the token-counting forward hook
    this connector put on the model's input embeddings.
    """

    def __init__(self, model: Any, pool: BlockPool, spec: KVSpec) -> None:
        """``model``: a transformers causal LM; ``pool``: a ``BlockPool`` (a ``PoolClient``); ``spec``: the
        namespace's KVSpec, checked against the model's own (layers, heads, dtype, fingerprint) and the
        pool's, so wrong KV can never be loaded.
        """
        self.model = model
        self.pool = pool
        self.spec = spec
        # a fingerprint revision is recomputed from these weights (so other weights are refused);
        # a pinned one is trusted as given
        pinned = None if is_fingerprint(spec.revision) or not spec.revision else spec.revision
        model_spec = spec_for_model(model, model_id=spec.model, block_tokens=spec.block_tokens, revision=pinned)
        spec.require_same(model_spec, "model")
        held = pool_spec(pool)
        if held is not None:
            held.require_same(spec, "connector")
        self.layout = probe_cache_layout(model)
        self._tokens_run = 0
        self._hook: Any = model.get_input_embeddings().register_forward_hook(self._count_tokens)

    def __enter__(self) -> HFConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the forward hook; idempotent. The connector refuses prefills afterwards."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @property
    def closed(self) -> bool:
        """True after ``close``: the connector then refuses prefills."""
        return self._hook is None

    def _count_tokens(self, _module: Any, inputs: tuple[Any, ...], _output: Any) -> None:
        """Count what the model actually embeds: the proof that hits are not recomputed."""
        self._tokens_run += int(inputs[0].numel())

    def _empty_cache(self) -> Any:
        """A cache of full layers only (no config): every layer keeps every token; see the module docstring."""
        from transformers import DynamicCache

        return DynamicCache()

    def load_prefix(self, hashes: Sequence[bytes], max_blocks: int) -> tuple[Any, int]:
        """A DynamicCache holding the longest verified cached prefix (<= max_blocks blocks)."""
        cache = self._empty_cache()
        want = self.pool.lookup(list(hashes[:max_blocks])) if max_blocks > 0 else 0
        if want == 0:
            return cache, 0
        dtype = getattr(torch, self.spec.dtype)
        device = next(self.model.parameters()).device
        if device.type == "cpu":
            return self._load_in_place(cache, hashes[:want], dtype)
        # the pool writes host memory; on a GPU model stage through pinned memory, one H2D copy
        buf = torch.empty(want, *self.spec.block_shape, dtype=dtype, pin_memory=device.type == "cuda")
        got = self.pool.get_into(list(hashes[:want]), buf)
        blocks = buf[:got].to(device, non_blocking=True)
        for layer in range(self.spec.num_layers if got else 0):
            kv = blocks_to_tokens(blocks, layer)  # [2, heads, tokens, dim]
            cache.update(kv[0].unsqueeze(0), kv[1].unsqueeze(0), layer)
        return cache, got

    def _load_in_place(self, cache: Any, hashes: Sequence[bytes], dtype: torch.dtype) -> tuple[Any, int]:
        """CPU model: copy the leased blocks straight from the arena into the per-layer K/V
        tensors the cache keeps (one copy per byte, no staging buffer)."""
        spec, t = self.spec, self.spec.block_tokens
        kv = torch.empty(
            spec.num_layers, spec.kv_factor, 1, spec.num_kv_heads, len(hashes) * t, spec.head_dim, dtype=dtype
        )

        def to_tokens(first: int, count: int, blocks: torch.Tensor) -> None:
            # blocks [n, layers, kv, heads, t, d] -> kv[layers, kv, 0, heads, tokens, d]
            dst = kv[:, :, 0, :, first * t : (first + count) * t].unflatten(3, (count, t))
            dst.copy_(blocks.permute(1, 2, 3, 0, 4, 5))

        got = load_blocks(self.pool, spec, dtype, hashes, to_tokens)
        for layer in range(spec.num_layers if got else 0):
            cache.update(kv[layer, 0, :, :, : got * t], kv[layer, 1, :, :, : got * t], layer)
        return cache, got

    def _check_cache_holds(self, cache: Any, tokens: int) -> None:
        """Right before a store: every layer must hold exactly this prompt's ``tokens`` K/V rows."""
        layers = getattr(cache, "layers", [])
        want = (1, self.spec.num_kv_heads, tokens, self.spec.head_dim)
        if len(layers) != self.spec.num_layers:
            raise InternalError(f"the cache has {len(layers)} layers, the spec {self.spec.num_layers}; nothing stored")
        for i, entry in enumerate(layers):
            for what, t in (("keys", entry.keys), ("values", entry.values)):
                if t is None or tuple(t.shape) != want:
                    got = None if t is None else tuple(t.shape)
                    raise InternalError(f"cache layer {i} {what} has shape {got}, expected {want}; nothing stored")

    def store_blocks(self, hashes: Sequence[bytes], cache: Any, first_block: int, end_block: int) -> int:
        """Put blocks [first_block, end_block) of ``cache`` into the pool; returns how many were sent."""
        n = end_block - first_block
        if n <= 0:
            return 0
        t, h, d = self.spec.block_tokens, self.spec.num_kv_heads, self.spec.head_dim
        dtype = getattr(torch, self.spec.dtype)

        def to_blocks(first: int, count: int, out: torch.Tensor) -> None:
            # each layer's K and V rows go straight into the put's slots (any device -> host, one copy)
            lo, hi = (first_block + first) * t, (first_block + first + count) * t
            for layer in range(self.spec.num_layers):
                entry = cache.layers[layer]
                for k, rows in enumerate((entry.keys, entry.values)):
                    out[:, layer, k].copy_(rows[0, :, lo:hi].reshape(h, count, t, d).permute(1, 0, 2, 3))

        staged = stage_blocks(self.pool, self.spec, dtype, hashes[first_block:end_block], to_blocks)
        if staged is not None:
            staged.commit()
        return n

    @torch.no_grad()
    def prefill(self, input_ids: Any, *, store: bool = True) -> PrefillResult:
        """Run one prompt, reusing the pool's longest cached prefix; see the module docstring.

        ``input_ids``: ``[tokens]`` or ``[1, tokens]``; more rows are refused before any work
        (``prefill_batch`` takes several prompts).
        """
        if self.closed:
            raise InvalidArgument("this HFConnector is closed", hint="create a new connector for the model")
        if self.model.training:
            raise InvalidArgument(
                "the model is in training mode: with dropout its KV is not a function of the prompt",
                hint="call model.eval() before serving it through the pool",
            )
        ids = _one_prompt(input_ids)
        n = ids.numel()
        if n == 0:
            raise InvalidArgument("empty prompt")
        t = self.spec.block_tokens
        hashes = self.pool.hashes(ids)
        cache, hit_blocks = self.load_prefix(hashes, (n - 1) // t)
        hit = hit_blocks * t
        before = self._tokens_run
        device = next(self.model.parameters()).device
        out = forward_with_cache(self.model, ids[hit:].unsqueeze(0).to(device), cache)
        run = self._tokens_run - before
        stored = 0
        out_cache = output_cache(out)
        if store and n // t > hit_blocks:
            self._check_cache_holds(out_cache, n)
            stored = self.store_blocks(hashes, out_cache, hit_blocks, n // t)
        return PrefillResult(
            logits=out.logits,
            cache=out_cache,
            prompt_tokens=n,
            hit_tokens=hit,
            tokens_run=run,
            stored_blocks=stored,
        )

    def prefill_batch(self, prompts: Any, *, store: bool = True) -> list[PrefillResult]:
        """Several prompts (a ``[rows, tokens]`` tensor or a sequence of 1-D prompts), one by one.

        Each row is its own prompt with its own hit; a later row hits blocks an earlier row
        stored. Rows run sequentially (no padding, so no pad token can enter a block hash).
        """
        rows = list(prompts.unbind(0)) if isinstance(prompts, torch.Tensor) and prompts.dim() == 2 else list(prompts)
        checked = [_one_prompt(row) for row in rows]  # refuse a bad row before any row runs
        return [self.prefill(row, store=store) for row in checked]

    @torch.no_grad()
    def generate_greedy(self, input_ids: Any, max_new_tokens: int) -> list[int]:
        """Greedy decode after a pool-assisted prefill (the prompt's blocks are stored first)."""
        result = self.prefill(input_ids)
        cache = result.cache
        token = int(result.logits[0, -1].argmax())
        produced = [token]
        device = next(self.model.parameters()).device
        for _ in range(max_new_tokens - 1):
            step = forward_with_cache(self.model, torch.tensor([[token]], device=device), cache)
            cache = output_cache(step)
            token = int(step.logits[0, -1].argmax())
            produced.append(token)
        return produced
