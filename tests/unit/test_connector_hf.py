"""HF connector on a random-weight tiny Llama: same logits as a full recompute, only misses run."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import tiny_llama

from kvpool.connectors.hf import HFConnector, spec_for_model
from kvpool.connectors.pool_api import InProcessPool
from kvpool.core.errors import SpecMismatch
from kvpool.core.spec import KVSpec

torch.set_num_threads(2)
BLOCK = 8


def full_logits(model: object, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.unsqueeze(0)).logits  # type: ignore[operator,attr-defined]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_hit_matches_full_recompute_and_runs_only_misses(dtype: torch.dtype) -> None:
    model = tiny_llama(dtype)
    spec = spec_for_model(model, model_id="tiny-llama", block_tokens=BLOCK)
    pool = InProcessPool(spec, salt=b"t")
    conn = HFConnector(model, pool, spec)
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 96, (37,), generator=gen)
    first = torch.cat([shared, torch.randint(0, 96, (5,), generator=gen)])
    r1 = conn.prefill(first)
    assert (r1.hit_tokens, r1.tokens_run, r1.stored_blocks) == (0, 42, 42 // BLOCK)

    second = torch.cat([shared, torch.randint(0, 96, (11,), generator=gen)])
    r2 = conn.prefill(second)
    assert r2.hit_tokens == (37 // BLOCK) * BLOCK == 32
    assert r2.tokens_run == second.numel() - r2.hit_tokens
    ref = full_logits(model, second)[:, r2.hit_tokens :]
    if dtype == torch.float32:
        assert torch.equal(r2.logits, ref)
    else:
        assert torch.allclose(r2.logits.float(), ref.float(), atol=3e-2, rtol=3e-2)
    assert torch.equal(r2.logits[0, -1].argmax(), ref[0, -1].argmax())


def test_fully_cached_prompt_still_runs_its_last_block() -> None:
    model = tiny_llama()
    spec = spec_for_model(model, model_id="tiny-llama", block_tokens=BLOCK)
    conn = HFConnector(model, InProcessPool(spec), spec)
    ids = torch.arange(32) % 96
    conn.prefill(ids)
    again = conn.prefill(ids)
    assert again.hit_tokens == 24 and again.tokens_run == 8
    assert torch.equal(again.logits, full_logits(model, ids)[:, 24:])


def test_corrupt_block_is_recomputed_not_served() -> None:
    model = tiny_llama()
    spec = spec_for_model(model, model_id="tiny-llama", block_tokens=BLOCK)
    pool = InProcessPool(spec)
    conn = HFConnector(model, pool, spec)
    ids = (torch.arange(41) * 7) % 96
    conn.prefill(ids)
    pool.corrupt(pool.hashes(ids)[2])  # blocks 0,1 good; block 2 fails its checksum
    r = conn.prefill(ids)
    assert r.hit_tokens == 2 * BLOCK and r.tokens_run == 41 - 16
    assert torch.equal(r.logits, full_logits(model, ids)[:, 16:])


def test_greedy_generation_same_with_and_without_pool_hits() -> None:
    model = tiny_llama()
    spec = spec_for_model(model, model_id="tiny-llama", block_tokens=BLOCK)
    conn = HFConnector(model, InProcessPool(spec), spec)
    ids = (torch.arange(30) * 5) % 96
    cold = conn.generate_greedy(ids, 6)
    warm = conn.generate_greedy(ids, 6)
    assert cold == warm
    with torch.no_grad():
        seq = ids.clone()
        for _ in range(6):
            seq = torch.cat([seq, full_logits(model, seq)[0, -1].argmax().view(1)])
    assert warm == seq[30:].tolist()


def test_other_model_revision_or_dtype_refused_naming_both() -> None:
    model = tiny_llama()
    spec = spec_for_model(model, model_id="tiny-llama", block_tokens=BLOCK)
    wrong = KVSpec("tiny-llama", 2, 2, 16, "bfloat16", BLOCK)
    with pytest.raises(SpecMismatch, match=r"bfloat16.*float32|float32.*bfloat16"):
        HFConnector(model, InProcessPool(wrong), wrong)
    other_rev = KVSpec("tiny-llama", 2, 2, 16, "float32", BLOCK, revision="v2")
    with pytest.raises(SpecMismatch, match="v2"):
        HFConnector(model, InProcessPool(other_rev), spec)
