"""The vLLM connector's GPU layouts on CUDA tensors (skipped without CUDA).

vLLM 0.32 on a GPU registers one ``[B, H, N, C]`` view per layer whose strides follow the
resolved layout: ``LBNHC`` (FlashAttention's default, "NHD": physical ``[B, N, H, C]``) or
``LBHNC`` (FlashInfer's "HND"), with ``C = K|V`` per token. These tests build exactly those
views on the device, save through the connector logic and load into another engine's pages,
and check the bytes against the backend's own split (``transpose(1, 2).split(head_size)``)
and against the same run on CPU tensors. What they cannot check without a GPU engine: that
a real FlashAttention engine hands over these strides (tests/vllm/ checks the CPU backend).
"""

from __future__ import annotations

import pytest
import torch

from kvpool.connectors.pool_api import InProcessPool
from kvpool.connectors.vllm import VllmPoolConnectorLogic
from kvpool.core.spec import KVSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SPEC = KVSpec("m", 3, 4, 64, "bfloat16", 32)  # pool block = 2 vLLM blocks of 16
PAGE = 16


def flash_view(pages: int, layout: str, device: str, seed: int) -> torch.Tensor:
    """A ``[B, H, N, C]`` view with the strides of ``layout`` over a fresh buffer."""
    gen = torch.Generator().manual_seed(seed)
    b, h, n, c = pages, SPEC.num_kv_heads, PAGE, 2 * SPEC.head_dim
    if layout == "LBNHC":  # physical [B, N, H, C]
        raw = torch.randn(b, n, h, c, generator=gen).to(torch.bfloat16).to(device)
        return raw.permute(0, 2, 1, 3)
    return torch.randn(b, h, n, c, generator=gen).to(torch.bfloat16).to(device)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER"])
def test_gpu_layouts_round_trip_and_match_the_backend_split(layout: str, backend: str) -> None:
    tokens = list(range(70))  # 2 pool blocks
    table_a, table_b = [9, 2, 7, 0, 5], [1, 3, 4, 6, 8]
    results = {}
    for device in ("cpu", "cuda"):
        pool = InProcessPool(SPEC)
        src = {f"model.layers.{i}.attn": flash_view(12, layout, device, i) for i in range(SPEC.num_layers)}
        producer = VllmPoolConnectorLogic(SPEC, pool, PAGE)
        producer.register_kv_caches(src, backend)
        plan = producer.plan_save("a", tokens, table_a, 0, 70)
        assert plan is not None
        producer.wait_for_save(producer.build_connector_meta([plan]))
        assert producer.drain_saves()
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        consumer = VllmPoolConnectorLogic(SPEC, pool, PAGE)
        consumer.register_kv_caches(dst, backend)
        assert consumer.get_num_new_matched_tokens("b", tokens, 0) == (64, False)
        consumer.update_state_after_alloc("b", table_b, 64)
        consumer.start_load_kv(consumer.build_connector_meta([]))
        assert consumer.get_block_ids_with_load_errors() == set()
        for name in src:
            k_src, v_src = src[name].transpose(1, 2).split(SPEC.head_dim, dim=-1)
            k_dst, v_dst = dst[name].transpose(1, 2).split(SPEC.head_dim, dim=-1)
            for pa, pb in zip(table_a[:4], table_b[:4]):
                assert torch.equal(k_dst[pb], k_src[pa]) and torch.equal(v_dst[pb], v_src[pa])
        got = torch.empty(2, *SPEC.block_shape, dtype=torch.bfloat16)
        assert pool.get_into(pool.hashes(tokens), got) == 2
        results[device] = got
        producer.shutdown()
        consumer.shutdown()
    assert torch.equal(results["cpu"], results["cuda"])  # the GPU path stores the CPU path's bytes
