"""vLLM and SGLang adapter logic over the real daemon and PoolClient (no engine installed)."""

from __future__ import annotations

import torch

from kvpool.client import PoolClient
from kvpool.connectors.sglang import HiCachePoolLogic, sglang_page_spec
from kvpool.connectors.vllm import VllmPoolConnectorLogic
from kvpool.core.spec import KVSpec

torch.set_num_threads(1)


def test_vllm_producer_and_consumer_share_blocks_through_daemon(pool_daemon) -> None:  # type: ignore[no-untyped-def]
    spec = KVSpec("m", 2, 2, 8, "bfloat16", 32)
    gen = torch.Generator().manual_seed(1)
    # vLLM 0.32's per-layer [B, H, N, C] view (FlashAttention packing: C = K|V per token)
    src = {f"model.layers.{i}.attn": torch.randn(20, 2, 16, 16, generator=gen).to(torch.bfloat16) for i in range(2)}
    prompt = list(range(1000, 1070))  # 2 full pool blocks of 32 tokens (= 4 vLLM blocks of 16) + 6
    with (
        PoolClient.connect(pool_daemon.address, spec, salt=b"t") as a,
        PoolClient.connect(pool_daemon.address, spec, salt=b"t") as b,
    ):
        producer = VllmPoolConnectorLogic(spec, a, 16)
        producer.register_kv_caches(src, "FLASH_ATTN")
        plan = producer.plan_save("p", prompt, [7, 3, 11, 0, 5], 0, 70)
        assert plan is not None
        producer.wait_for_save(producer.build_connector_meta([plan]))
        assert producer.drain_saves()
        producer.shutdown()

        consumer = VllmPoolConnectorLogic(spec, b, 16)
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        consumer.register_kv_caches(dst, "FLASH_ATTN")
        assert consumer.get_num_new_matched_tokens("c", prompt, 0) == (64, False)
        consumer.update_state_after_alloc("c", [1, 2, 4, 6, 8], 64)
        consumer.start_load_kv(consumer.build_connector_meta([]))
        assert consumer.get_block_ids_with_load_errors() == set()
        for name in src:
            for pa, pb in zip([7, 3, 11, 0], [1, 2, 4, 6]):
                assert torch.equal(dst[name][pb], src[name][pa])
        consumer.shutdown()


def test_sglang_pages_through_daemon(pool_daemon) -> None:  # type: ignore[no-untyped-def]
    spec = sglang_page_spec("qwen", 2, 2, 8, "bfloat16", 16, "layer_first", 0, 1)
    pages = [torch.randn(spec.block_bytes // 2).to(torch.bfloat16) for _ in range(3)]
    with PoolClient.connect(pool_daemon.address, spec, salt=b"s") as client:
        store = HiCachePoolLogic(client, spec, b"s")
        assert store.batch_set(["k0", "k1", "k2"], pages)
        assert store.batch_exists(["k0", "k1", "k2", "k3"]) == 3
        got = store.batch_get(["k0", "k1", "k2"])
        assert all(g is not None and torch.equal(g, p) for g, p in zip(got, pages))
    with PoolClient.connect(pool_daemon.address, spec, salt=b"other") as other:
        assert HiCachePoolLogic(other, spec, b"other").batch_exists(["k0"]) == 0
