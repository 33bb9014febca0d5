"""Measure the reference engine for the scheduler's cost model.

The scheduler fits prefill time as a function of (new tokens, cached prefix tokens) and decode
step time as a function of (batch size, context tokens per sequence). This module produces
those samples from the real ``RefModel`` forward pass on this machine; fetching the cached
prefix is not included (the cost model adds transfer time from bytes and link bandwidth).

KV values do not change the cost of attention, so cached context is filled with random KV
instead of being computed: profiling an 8K-token context costs one forward, not two.
The clock is passed in (seconds, monotonic), so tests drive it by hand.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvpool.core.errors import InvalidArgument
from kvpool.engine.model import ModelConfig, RefModel
from kvpool.kernels.paged import TORCH_DTYPES

PAGE_TOKENS = 16


@dataclass(frozen=True)
class PrefillSample:
    new_tokens: int
    cached_tokens: int
    seconds: float


@dataclass(frozen=True)
class DecodeSample:
    batch: int
    context_tokens: int
    seconds: float


def _caches(model: RefModel, total_tokens: int, gen: torch.Generator) -> list[torch.Tensor]:
    c = model.config
    pages = -(-total_tokens // PAGE_TOKENS)
    dtype = TORCH_DTYPES[c.dtype]
    shape = (2, pages, PAGE_TOKENS, c.num_kv_heads, c.head_dim)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(c.num_layers)]


def profile_prefill(
    model_config: ModelConfig,
    points: Sequence[tuple[int, int]],
    *,
    repeats: int = 1,
    clock_s: Callable[[], float] = time.perf_counter,
    seed: int = 0,
) -> list[PrefillSample]:
    """Best-of-``repeats`` time of one prefill forward for each (new_tokens, cached_tokens)."""
    if repeats <= 0:
        raise InvalidArgument("repeats must be positive")
    model = RefModel(model_config)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for new, cached in points:
        if new <= 0 or cached < 0:
            raise InvalidArgument(f"bad profile point (new={new}, cached={cached})")
        caches = _caches(model, new + cached, gen)
        tokens = torch.randint(0, model_config.vocab_size, (new,), generator=gen)
        positions = torch.arange(cached, cached + new)
        slots = torch.arange(cached + new)
        best = float("inf")
        for _ in range(repeats):
            start = clock_s()
            model.forward(tokens, positions, [(0, new, slots)], caches, PAGE_TOKENS)
            best = min(best, clock_s() - start)
        out.append(PrefillSample(new, cached, best))
    return out


def profile_decode(
    model_config: ModelConfig,
    points: Sequence[tuple[int, int]],
    *,
    repeats: int = 1,
    clock_s: Callable[[], float] = time.perf_counter,
    seed: int = 0,
) -> list[DecodeSample]:
    """Best-of-``repeats`` time of one decode step of ``batch`` sequences at ``context`` tokens each."""
    if repeats <= 0:
        raise InvalidArgument("repeats must be positive")
    model = RefModel(model_config)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for batch, context in points:
        if batch <= 0 or context <= 0:
            raise InvalidArgument(f"bad profile point (batch={batch}, context={context})")
        per_seq_pages = -(-context // PAGE_TOKENS)
        caches = _caches(model, batch * per_seq_pages * PAGE_TOKENS, gen)
        tokens = torch.randint(0, model_config.vocab_size, (batch,), generator=gen)
        positions = torch.full((batch,), context - 1)
        seqs = [(i, 1, torch.arange(context) + i * per_seq_pages * PAGE_TOKENS) for i in range(batch)]
        best = float("inf")
        for _ in range(repeats):
            start = clock_s()
            model.forward(tokens, positions, seqs, caches, PAGE_TOKENS)
            best = min(best, clock_s() - start)
        out.append(DecodeSample(batch, context, best))
    return out
