"""Compressed pool: int8/fp8 blocks round-trip within the bound, never mix with exact blocks."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import tiny_llama

from kvpool.connectors.compressed_pool import CompressedPool, compressed_spec, pack, unpack
from kvpool.connectors.hf import HFConnector, spec_for_model
from kvpool.connectors.pool_api import InProcessPool
from kvpool.core.errors import InvalidArgument, SpecMismatch
from kvpool.core.hashing import block_hashes
from kvpool.core.spec import KVSpec, Namespace
from kvpool.kernels.quant import error_bound

torch.set_num_threads(2)


@pytest.mark.parametrize("codec", ["int8", "fp8"])
@pytest.mark.parametrize("head_dim", [4, 16])
def test_pack_unpack_within_bound_and_smaller(codec: str, head_dim: int) -> None:
    spec = KVSpec("m", 2, 8, head_dim, "bfloat16", 8)
    x = (torch.randn(3, *spec.block_shape) * 4).to(torch.bfloat16)
    raw = pack(x, codec)
    wire = compressed_spec(spec, codec)
    assert tuple(raw.shape[1:]) == wire.block_shape and raw.dtype == torch.uint8
    y = unpack(raw, codec, torch.bfloat16)
    bf16_rounding = y.float().abs() * 2.0**-8  # decoding into bf16 adds its own rounding
    assert bool(((x.float() - y.float()).abs() <= error_bound(x, codec) * (1 + 1e-5) + bf16_rounding).all())
    assert wire.block_bytes == spec.block_bytes * 9 // 16  # 8 heads of 1-byte values + 1 head of scales


def test_compressed_namespace_never_matches_exact() -> None:
    spec = KVSpec("m", 2, 2, 16, "bfloat16", 8)
    tokens = list(range(32))
    exact = block_hashes(Namespace(spec), tokens)
    assert not set(exact) & set(block_hashes(Namespace(compressed_spec(spec, "int8")), tokens))
    assert compressed_spec(spec, "int8") != compressed_spec(spec, "fp8")
    with pytest.raises(SpecMismatch):
        CompressedPool(InProcessPool(spec), spec, "int8")  # inner pool holds exact blocks: refused
    with pytest.raises(InvalidArgument):
        compressed_spec(KVSpec("m", 1, 1, 4, "int8", 4), "int8")
    with pytest.raises(InvalidArgument):  # 16 scales (64 bytes) do not fit in one 2x2-byte head
        compressed_spec(KVSpec("m", 1, 16, 2, "float32", 2), "int8")


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_hf_connector_over_compressed_pool_close_to_recompute(codec: str) -> None:
    model = tiny_llama()
    spec = spec_for_model(model, model_id="tiny", block_tokens=8)
    pool = CompressedPool(InProcessPool(compressed_spec(spec, codec)), spec, codec)
    conn = HFConnector(model, pool, spec)
    ids = (torch.arange(45) * 11) % 96
    conn.prefill(ids)
    again = conn.prefill(ids)
    assert again.hit_tokens == 40 and again.tokens_run == 5
    with torch.no_grad():
        ref = model(ids.unsqueeze(0)).logits[:, 40:]
    assert not torch.equal(again.logits, ref)  # lossy, as documented
    assert torch.allclose(again.logits, ref, atol=5e-2, rtol=0)
    assert torch.equal(again.logits.argmax(-1), ref.argmax(-1))
