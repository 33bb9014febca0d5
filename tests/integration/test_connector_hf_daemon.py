"""HF connector against the real daemon and PoolClient: a second process-like client reuses the prefix."""

from __future__ import annotations

import torch
from hf_helpers import tiny_llama

from kvpool.client import PoolClient
from kvpool.connectors.hf import HFConnector, spec_for_model

torch.set_num_threads(2)


def test_prefix_through_daemon_same_logits_only_misses_run(pool_daemon) -> None:  # type: ignore[no-untyped-def]
    model = tiny_llama()
    spec = spec_for_model(model, model_id="tiny-llama", block_tokens=16)
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 96, (70,), generator=gen)
    with PoolClient.connect(pool_daemon.address, spec, salt=b"tenant-a") as writer:
        first = HFConnector(model, writer, spec).prefill(torch.cat([shared, torch.tensor([1, 2, 3])]))
        assert first.hit_tokens == 0 and first.stored_blocks == 4
    with PoolClient.connect(pool_daemon.address, spec, salt=b"tenant-a") as reader:
        prompt = torch.cat([shared, torch.randint(0, 96, (9,), generator=gen)])
        result = HFConnector(model, reader, spec).prefill(prompt, store=False)
        assert result.hit_tokens == 64 and result.tokens_run == prompt.numel() - 64
        with torch.no_grad():
            ref = model(prompt.unsqueeze(0)).logits[:, 64:]  # type: ignore[operator]
        assert torch.equal(result.logits, ref)
    with PoolClient.connect(pool_daemon.address, spec, salt=b"tenant-b") as other_tenant:
        assert HFConnector(model, other_tenant, spec).prefill(prompt, store=False).hit_tokens == 0


def test_int8_compressed_blocks_through_daemon(pool_daemon) -> None:  # type: ignore[no-untyped-def]
    from kvpool.connectors.compressed_pool import CompressedPool, compressed_spec

    model = tiny_llama()
    spec = spec_for_model(model, model_id="tiny-llama", block_tokens=16)
    prompt = (torch.arange(50) * 13) % 96
    with PoolClient.connect(pool_daemon.address, compressed_spec(spec, "int8")) as wire:
        pool = CompressedPool(wire, spec, "int8")
        HFConnector(model, pool, spec).prefill(prompt)
        result = HFConnector(model, pool, spec).prefill(prompt, store=False)
        assert result.hit_tokens == 48 and result.tokens_run == 2
        with torch.no_grad():
            ref = model(prompt.unsqueeze(0)).logits[:, 48:]  # type: ignore[operator]
        assert torch.allclose(result.logits, ref, atol=5e-2, rtol=0)
    with PoolClient.connect(pool_daemon.address, spec) as exact:  # the exact namespace sees none of it
        assert exact.lookup(exact.hashes(prompt)) == 0


def test_sliding_window_and_other_weights_through_daemon(pool_daemon) -> None:  # type: ignore[no-untyped-def]
    """Issue 11 live: a window just above a block multiple hits exactly; other weights get 0 hits."""
    from hf_helpers import tiny_model

    model, other = tiny_model("mistral-w65", seed=0), tiny_model("mistral-w65", seed=1)
    spec = spec_for_model(model, model_id="mistral", block_tokens=16)
    spec_other = spec_for_model(other, model_id="mistral", block_tokens=16)
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 96, (64,), generator=gen)
    prompt = torch.cat([shared, torch.randint(0, 96, (6,), generator=gen)])
    with PoolClient.connect(pool_daemon.address, spec) as client, HFConnector(model, client, spec) as conn:
        conn.prefill(torch.cat([shared, torch.randint(0, 96, (6,), generator=gen)]))
        result = conn.prefill(prompt, store=False)
        assert result.hit_tokens == 64 and result.tokens_run == 6
        with torch.no_grad():
            ref = model(prompt.unsqueeze(0)).logits[:, 64:]  # type: ignore[operator]
        assert torch.equal(result.logits, ref)
    with PoolClient.connect(pool_daemon.address, spec_other) as client, HFConnector(other, client, spec_other) as conn:
        assert conn.prefill(prompt, store=False).hit_tokens == 0  # same model id, other weights
