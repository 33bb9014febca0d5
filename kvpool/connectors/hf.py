"""Hugging Face transformers connector: prefill only the tokens the pool does not hold.

For a causal LM on transformers 5.x (``DynamicCache`` with ``cache.layers[i].keys/values``
of shape ``[batch, kv_heads, tokens, head_dim]``):

1. hash the prompt's full blocks in the pool's namespace and find the longest cached prefix
   (at most ``len(prompt) - 1`` tokens, so the last token always runs and yields logits);
2. read those blocks into one host buffer (checksummed by the pool; a bad block truncates the
   hit and the rest is recomputed), and build a ``DynamicCache`` from them;
3. run the model on the missed suffix only;
4. store the prompt's new full blocks back (the pool skips ones it already has).

The model's spec (layers, kv heads, head_dim, dtype) must equal the pool namespace's spec:
a mismatch is refused before a byte is copied, naming both specs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvpool.connectors.pool_api import BlockPool, pool_spec
from kvpool.core.errors import InvalidArgument
from kvpool.core.spec import KVSpec
from kvpool.kernels.paged import blocks_to_tokens, tokens_to_blocks

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def spec_for_model(model: Any, *, model_id: str, block_tokens: int, revision: str = "") -> KVSpec:
    """The KVSpec of a transformers causal LM's KV cache (reads ``model.config`` and dtype)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = _DTYPE_NAMES.get(model.dtype)
    if dtype is None:
        raise InvalidArgument(f"model dtype {model.dtype} has no pool dtype", hint="use float32/float16/bfloat16")
    return KVSpec(
        model=model_id,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        block_tokens=block_tokens,
        revision=revision,
    )


@dataclass(frozen=True)
class PrefillResult:
    """What one prefill did. ``logits`` covers only the tokens that ran: ``[1, tokens_run, vocab]``."""

    logits: torch.Tensor
    cache: Any
    prompt_tokens: int
    hit_tokens: int
    tokens_run: int
    stored_blocks: int


class HFConnector:
    """Prefix reuse for one transformers model against one pool namespace."""

    def __init__(self, model: Any, pool: BlockPool, spec: KVSpec) -> None:
        self.model = model
        self.pool = pool
        self.spec = spec
        model_spec = spec_for_model(model, model_id=spec.model, block_tokens=spec.block_tokens, revision=spec.revision)
        spec.require_same(model_spec, "model")
        held = pool_spec(pool)
        if held is not None:
            held.require_same(spec, "connector")
        self._tokens_run = 0
        embed = model.get_input_embeddings()
        embed.register_forward_hook(self._count_tokens)

    def _count_tokens(self, _module: Any, inputs: tuple[Any, ...], _output: Any) -> None:
        """Count what the model actually embeds: the proof that hits are not recomputed."""
        self._tokens_run += int(inputs[0].numel())

    def _empty_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def load_prefix(self, hashes: Sequence[bytes], max_blocks: int) -> tuple[Any, int]:
        """A DynamicCache holding the longest verified cached prefix (<= max_blocks blocks)."""
        cache = self._empty_cache()
        want = self.pool.lookup(list(hashes[:max_blocks])) if max_blocks > 0 else 0
        if want == 0:
            return cache, 0
        dtype = getattr(torch, self.spec.dtype)
        device = next(self.model.parameters()).device
        # the pool writes host memory; on a GPU model stage through pinned memory, one H2D copy
        buf = torch.empty(want, *self.spec.block_shape, dtype=dtype, pin_memory=device.type == "cuda")
        got = self.pool.get_into(list(hashes[:want]), buf)
        blocks = buf[:got].to(device, non_blocking=True)
        for layer in range(self.spec.num_layers if got else 0):
            kv = blocks_to_tokens(blocks, layer)  # [2, heads, tokens, dim]
            cache.update(kv[0].unsqueeze(0), kv[1].unsqueeze(0), layer)
        return cache, got

    def store_blocks(self, hashes: Sequence[bytes], cache: Any, first_block: int, end_block: int) -> int:
        """Put blocks [first_block, end_block) of ``cache`` into the pool; returns how many were sent."""
        n = end_block - first_block
        if n <= 0:
            return 0
        t = self.spec.block_tokens
        dtype = getattr(torch, self.spec.dtype)
        out = torch.empty(n, *self.spec.block_shape, dtype=dtype)
        for layer in range(self.spec.num_layers):
            entry = cache.layers[layer]
            keys = entry.keys[0, :, first_block * t : end_block * t]
            values = entry.values[0, :, first_block * t : end_block * t]
            tokens_to_blocks(torch.stack([keys, values]).cpu(), out, layer)
        self.pool.put(list(hashes[first_block:end_block]), out)
        return n

    @torch.no_grad()
    def prefill(self, input_ids: Any, *, store: bool = True) -> PrefillResult:
        """Run the prompt, reusing the pool's longest cached prefix; see the module docstring."""
        ids = torch.as_tensor(input_ids).reshape(-1)
        n = ids.numel()
        if n == 0:
            raise InvalidArgument("empty prompt")
        t = self.spec.block_tokens
        hashes = self.pool.hashes(ids)
        cache, hit_blocks = self.load_prefix(hashes, (n - 1) // t)
        hit = hit_blocks * t
        before = self._tokens_run
        device = next(self.model.parameters()).device
        out = self.model(ids[hit:].unsqueeze(0).to(device), cache=cache, use_cache=True)
        run = self._tokens_run - before
        stored = self.store_blocks(hashes, out.cache, hit_blocks, n // t) if store else 0
        return PrefillResult(
            logits=out.logits,
            cache=out.cache,
            prompt_tokens=n,
            hit_tokens=hit,
            tokens_run=run,
            stored_blocks=stored,
        )

    @torch.no_grad()
    def generate_greedy(self, input_ids: Any, max_new_tokens: int) -> list[int]:
        """Greedy decode after a pool-assisted prefill (the prompt's blocks are stored first)."""
        result = self.prefill(input_ids)
        cache = result.cache
        token = int(result.logits[0, -1].argmax())
        produced = [token]
        device = next(self.model.parameters()).device
        for _ in range(max_new_tokens - 1):
            step = self.model(torch.tensor([[token]], device=device), cache=cache, use_cache=True)
            cache = step.cache
            token = int(step.logits[0, -1].argmax())
            produced.append(token)
        return produced
