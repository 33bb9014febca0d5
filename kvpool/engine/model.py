"""A small Llama-style decoder in plain torch, over a paged KV cache.

Deterministic weights from a seed (``torch.Generator``), RMSNorm, rotary embeddings, GQA,
SwiGLU MLP. It is the model the reference engine serves, the PD demo runs and the
scheduler's cost model is fitted on. Every op is batched over all tokens of a step
(continuous batching), except attention, which runs per sequence over that sequence's
pages (queries in chunks of 256, so an 8K-token prefill never builds an 8K x 8K score matrix).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpool.connectors.fingerprint import tensors_fingerprint
from kvpool.core.errors import InvalidArgument
from kvpool.core.spec import KVSpec
from kvpool.kernels.paged import TORCH_DTYPES

#: Query rows per attention call: bounds the score matrix at chunk x context. Masked chunks of
#: 256 rows ran 2-3x faster on this CPU than SDPA's fused causal kernel over a whole prompt
#: (bit-identical output), so cold prefill uses them too: the cold baseline is not handicapped.
ATTN_QUERY_CHUNK = 256


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the reference model. Defaults: ~3M parameters, fast on a 2-core CPU."""

    vocab_size: int = 1024
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 768
    rope_theta: float = 10_000.0
    rms_eps: float = 1e-5
    dtype: str = "float32"
    seed: int = 0
    name: str = "kvpool-ref-llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise InvalidArgument("head_dim must be even (rotary embeddings rotate pairs)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise InvalidArgument(f"dtype {self.dtype!r} must be float32, bfloat16 or float16")

    def kv_spec(self, block_tokens: int) -> KVSpec:
        """The pool namespace spec of this model's KV: ``RefModel(self).kv_spec(block_tokens)``.

        Builds the weights to fingerprint them (one model init); where a ``RefModel`` exists,
        ask it (or ``Engine.spec``) instead.
        """
        return RefModel(self).kv_spec(block_tokens)


class RefModel:
    """Weights and the forward pass. Not an nn.Module: no autograd, no hooks, no hidden state."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        c = config
        gen = torch.Generator().manual_seed(c.seed)
        dtype = TORCH_DTYPES[c.dtype]

        def weight(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=gen) / cols**0.5).to(dtype)

        self.embed = (torch.randn(c.vocab_size, c.hidden_size, generator=gen) * 0.5).to(dtype)
        self.layers = []
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for _ in range(c.num_layers):
            self.layers.append(
                {
                    "attn_norm": torch.ones(c.hidden_size, dtype=dtype),
                    "wqkv": weight(q_out + 2 * kv_out, c.hidden_size),
                    "wo": weight(c.hidden_size, q_out),
                    "mlp_norm": torch.ones(c.hidden_size, dtype=dtype),
                    "w_gate_up": weight(2 * c.intermediate_size, c.hidden_size),
                    "w_down": weight(c.hidden_size, c.intermediate_size),
                }
            )
        self.final_norm = torch.ones(c.hidden_size, dtype=dtype)
        self.lm_head = weight(c.vocab_size, c.hidden_size)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        self._inv_freq = inv
        self._fingerprint: str | None = None

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor the forward reads, by name (what the weight fingerprint covers)."""
        named = [("embed", self.embed), ("final_norm", self.final_norm), ("lm_head", self.lm_head)]
        named.append(("inv_freq", self._inv_freq))
        for i, layer in enumerate(self.layers):
            named += [(f"layers.{i}.{k}", t) for k, t in layer.items()]
        return named

    def fingerprint(self) -> str:
        """Weight fingerprint (``kvpool.connectors.fingerprint``), computed once: the weights never change.

        Why not the seed: the weights are a function of the seed *and* of every shape and of
        torch's generator; a label of a few fields (the old ``seed0-h256-v1024``) let two models
        with other ``intermediate_size`` or ``rope_theta`` share a namespace. ``extra`` carries
        the config fields that are not in any tensor (``rms_eps``, head counts).
        """
        if self._fingerprint is None:
            fields = {k: v for k, v in dataclasses.asdict(self.config).items() if k != "name"}
            extra = json.dumps(fields, sort_keys=True).encode()
            self._fingerprint = tensors_fingerprint(self.named_tensors(), extra)
        return self._fingerprint

    def kv_spec(self, block_tokens: int) -> KVSpec:
        """The pool namespace spec of this model's KV; the revision is the weight fingerprint."""
        c = self.config
        return KVSpec(
            model=c.name,
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            dtype=c.dtype,
            block_tokens=block_tokens,
            revision=self.fingerprint(),
        )

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_eps)).to(x.dtype) * w

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim] rotated by absolute positions (half-split convention)."""
        ang = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        cos = torch.cos(ang).to(torch.float32)[:, None, :]
        sin = torch.sin(ang).to(torch.float32)[:, None, :]
        xf = x.float()
        half = xf.shape[-1] // 2
        a, b = xf[..., :half], xf[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        seqs: list[tuple[int, int, torch.Tensor]],
        kv_caches: list[torch.Tensor],
        page_tokens: int,
    ) -> torch.Tensor:
        """One step over a flat batch; returns the logits of each sequence's last token.

        ``tokens``/``positions``: [N]. ``seqs``: per sequence (offset into the batch, number of
        new tokens, slot ids of its whole context so far including the new tokens, in
        position order). ``kv_caches``: per layer ``[2, pages, page_tokens, kv_heads, head_dim]``.
        New K/V are written to their slots before attention reads the context.
        """
        c = self.config
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        x = self.embed[tokens]
        for layer, w in enumerate(self.layers):
            h = self._rms(x, w["attn_norm"])
            qkv = h @ w["wqkv"].T
            q = self._rope(qkv[:, :q_out].view(-1, c.num_heads, c.head_dim), positions)
            k = self._rope(qkv[:, q_out : q_out + kv_out].view(-1, c.num_kv_heads, c.head_dim), positions)
            v = qkv[:, q_out + kv_out :].view(-1, c.num_kv_heads, c.head_dim)
            flat = kv_caches[layer].view(2, -1, c.num_kv_heads, c.head_dim)  # [2, slots, H, D]
            attn = torch.empty(x.shape[0], c.num_heads, c.head_dim, dtype=x.dtype)
            for offset, count, slots in seqs:
                new_slots = slots[-count:]
                flat[0].index_copy_(0, new_slots, k[offset : offset + count])
                flat[1].index_copy_(0, new_slots, v[offset : offset + count])
                ctx_k = flat[0].index_select(0, slots).transpose(0, 1)  # [H, ctx, D]
                ctx_v = flat[1].index_select(0, slots).transpose(0, 1)
                ctx = slots.numel()
                group = c.num_heads // c.num_kv_heads
                if group > 1:  # GQA: share each kv head with its query group (equal heads: faster SDPA on CPU)
                    ctx_k = ctx_k.repeat_interleave(group, dim=0)
                    ctx_v = ctx_v.repeat_interleave(group, dim=0)
                for q0 in range(0, count, ATTN_QUERY_CHUNK):
                    q1 = min(count, q0 + ATTN_QUERY_CHUNK)
                    first_pos = ctx - count + q0  # absolute position of query row q0
                    qs = q[offset + q0 : offset + q1].transpose(0, 1)  # [heads, rows, D]
                    keys = first_pos + (q1 - q0)
                    mask = torch.arange(keys)[None, :] <= (first_pos + torch.arange(q1 - q0))[:, None]
                    out = F.scaled_dot_product_attention(qs, ctx_k[:, :keys], ctx_v[:, :keys], attn_mask=mask)
                    attn[offset + q0 : offset + q1] = out.transpose(0, 1)
            x = x + attn.reshape(-1, q_out) @ w["wo"].T
            h = self._rms(x, w["mlp_norm"])
            gate, up = (h @ w["w_gate_up"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w["w_down"].T
        last = torch.tensor([offset + count - 1 for offset, count, _ in seqs], dtype=torch.long)
        return self._rms(x[last], self.final_norm).float() @ self.lm_head.float().T

    @torch.no_grad()
    def reference_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of every position of one sequence, no paging (the oracle for tests)."""
        c = self.config
        n = tokens.numel()
        page = 16
        pages = -(-n // page)
        caches = [torch.zeros(2, pages, page, c.num_kv_heads, c.head_dim, dtype=self.embed.dtype) for _ in self.layers]
        out = []
        for i in range(n):  # token by token: exercises the decode path as the oracle
            slots = torch.arange(i + 1)
            out.append(self.forward(tokens[i : i + 1], torch.tensor([i]), [(0, 1, slots)], caches, page))
        return torch.cat(out)
