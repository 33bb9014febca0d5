"""vLLM adapter logic without vLLM: hash mapping, block tables -> pool blocks, load errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.connectors.pool_api import InProcessPool
from kvpool.connectors.vllm import VllmPoolConnectorLogic, layer_order, pages_for_blocks
from kvpool.core.errors import InvalidArgument, SpecMismatch
from kvpool.core.spec import KVSpec

torch.set_num_threads(1)
SPEC = KVSpec("m", 2, 2, 4, "float32", 8)  # pool blocks of 8 tokens = 2 vLLM blocks of 4
PAGE = 4


def caches(seed: int, pages: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(2, pages, PAGE, 2, 4, generator=gen) for i in (1, 0)}


def test_layer_order_and_pages_for_blocks() -> None:
    assert layer_order(["model.layers.10.attn", "model.layers.2.attn"]) == [
        "model.layers.2.attn",
        "model.layers.10.attn",
    ]
    assert pages_for_blocks([7, 3, 9, 1, 5, 2], 1, 2, 2) == [9, 1, 5, 2]
    with pytest.raises(InvalidArgument):
        pages_for_blocks([7, 3], 1, 1, 2)


def test_producer_saves_then_consumer_loads_same_kv() -> None:
    pool = InProcessPool(SPEC)
    tokens = list(range(21))  # 2 full pool blocks + 5 tokens
    producer = VllmPoolConnectorLogic(SPEC, pool, PAGE)
    src = caches(1)
    producer.register_kv_caches(src)
    assert producer.get_num_new_matched_tokens("a", tokens, 0) == (0, False)
    table_a = [4, 0, 6, 2, 9, 11]
    save1 = producer.plan_save("a", tokens, table_a, 0, 12)  # chunk 1: 12 tokens -> block 0 complete
    save2 = producer.plan_save("a", tokens, table_a, 12, 9)  # chunk 2: to 21 -> block 1 complete
    assert save1 is not None and save2 is not None
    assert (save1.page_ids, save2.page_ids) == ((4, 0), (6, 2))
    assert producer.plan_save("a", tokens, table_a, 21, 1) is None  # decode tokens are not saved
    producer.wait_for_save(producer.build_connector_meta([save1, save2]))
    assert producer.request_finished("a") == (False, None)

    consumer = VllmPoolConnectorLogic(SPEC, pool, PAGE)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    consumer.register_kv_caches(dst)
    assert consumer.get_num_new_matched_tokens("b", tokens, 0) == (16, False)
    assert consumer.get_num_new_matched_tokens("b", tokens, 8) == (8, False)  # vLLM had block 0 locally
    assert consumer.get_num_new_matched_tokens("b", tokens, 4) == (0, False)  # local hit ends mid pool block
    table_b = [1, 3, 5, 7, 8, 10]
    consumer.update_state_after_alloc("b", table_b, 0, 16)
    consumer.start_load_kv(consumer.build_connector_meta([]))
    assert consumer.get_block_ids_with_load_errors() == set()
    for name in src:
        for a_page, b_page in zip(table_a[:4], table_b[:4]):
            assert torch.equal(dst[name][:, b_page], src[name][:, a_page])
        assert torch.equal(dst[name][:, 8], torch.zeros(2, PAGE, 2, 4))  # nothing past the hit


def test_failed_block_reported_as_load_error_for_exactly_its_pages() -> None:
    pool = InProcessPool(SPEC)
    tokens = list(range(30))
    writer = VllmPoolConnectorLogic(SPEC, pool, PAGE)
    writer.register_kv_caches(caches(2))
    plan = writer.plan_save("w", tokens, list(range(8)), 0, 30)
    assert plan is not None
    writer.wait_for_save(writer.build_connector_meta([plan]))
    reader = VllmPoolConnectorLogic(SPEC, pool, PAGE)
    reader.register_kv_caches({k: torch.zeros_like(v) for k, v in caches(0).items()})
    assert reader.get_num_new_matched_tokens("r", tokens, 0) == (24, False)
    pool.corrupt(pool.hashes(tokens)[1])  # corrupted after the lookup, before the load
    reader.update_state_after_alloc("r", [10, 11, 12, 13, 14, 15, 3, 2], 0, 24)
    reader.start_load_kv(reader.build_connector_meta([]))
    assert reader.get_block_ids_with_load_errors() == {12, 13, 14, 15}  # blocks 1 and 2 -> pages
    assert reader.get_block_ids_with_load_errors() == set()  # reported once


def test_tp_reader_loads_only_its_heads_and_bad_caches_refused() -> None:
    pool = InProcessPool(SPEC)
    tokens = list(range(9))
    writer = VllmPoolConnectorLogic(SPEC, pool, PAGE)
    src = caches(3)
    writer.register_kv_caches(src)
    plan = writer.plan_save("w", tokens, [0, 1, 2], 0, 9)
    assert plan is not None
    writer.wait_for_save(writer.build_connector_meta([plan]))
    for rank in range(2):
        reader = VllmPoolConnectorLogic(SPEC, pool, PAGE, tp_rank=rank, tp_size=2)
        mine = {k: torch.zeros(2, 16, PAGE, 1, 4) for k in src}
        reader.register_kv_caches(mine)
        assert reader.get_num_new_matched_tokens("r", tokens, 0) == (8, False)
        reader.update_state_after_alloc("r", [5, 6, 7], 0, 8)
        reader.start_load_kv(reader.build_connector_meta([]))
        for name in src:
            assert torch.equal(mine[name][:, 5:7], src[name][:, 0:2, :, rank : rank + 1])
        with pytest.raises(InvalidArgument):  # no head_allgather given
            reader.wait_for_save(reader.build_connector_meta([plan]))
    bad = VllmPoolConnectorLogic(SPEC, pool, PAGE)
    with pytest.raises(SpecMismatch):
        bad.register_kv_caches({k: v.to(torch.bfloat16) for k, v in src.items()})
    with pytest.raises(InvalidArgument):
        VllmPoolConnectorLogic(SPEC, pool, 3)


def test_lazy_vllm_class_needs_vllm() -> None:
    import kvpool.connectors.vllm as mod

    with pytest.raises(ImportError):
        _ = mod.KvpoolConnector


def test_tp2_writer_saves_whole_blocks_through_head_allgather() -> None:
    import threading

    pool = InProcessPool(SPEC)
    tokens = list(range(17))
    full = caches(4)  # what a TP=1 engine would hold: both heads
    barrier = threading.Barrier(2)
    parts: dict[int, torch.Tensor] = {}

    def allgather_for(rank: int):  # type: ignore[no-untyped-def]
        def gather(t: torch.Tensor) -> torch.Tensor:
            parts[rank] = t
            barrier.wait()
            return torch.cat([parts[0], parts[1]], dim=3)

        return gather

    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            logic = VllmPoolConnectorLogic(SPEC, pool, PAGE, rank, 2, allgather_for(rank))
            logic.register_kv_caches({k: v[:, :, :, rank : rank + 1].clone() for k, v in full.items()})
            plan = logic.plan_save("w", tokens, [3, 1, 0, 2, 5], 0, 17)
            assert plan is not None
            logic.wait_for_save(logic.build_connector_meta([plan]))
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors
    reference = InProcessPool(SPEC)
    tp1 = VllmPoolConnectorLogic(SPEC, reference, PAGE)
    tp1.register_kv_caches(full)
    plan = tp1.plan_save("w", tokens, [3, 1, 0, 2, 5], 0, 17)
    assert plan is not None
    tp1.wait_for_save(tp1.build_connector_meta([plan]))
    hashes = pool.hashes(tokens)
    a = torch.empty(2, *SPEC.block_shape)
    b = torch.empty(2, *SPEC.block_shape)
    assert pool.get_into(hashes, a) == 2 and reference.get_into(hashes, b) == 2
    assert torch.equal(a, b)  # TP=2 ranks together stored exactly what TP=1 stores


@settings(max_examples=60, deadline=None)
@given(
    prompt_len=st.integers(1, 60),
    chunks=st.lists(st.integers(1, 20), min_size=1, max_size=12),
    local_hit_blocks=st.integers(0, 3),
)
def test_chunked_schedule_saves_each_full_prompt_block_once_in_order(
    prompt_len: int, chunks: list[int], local_hit_blocks: int
) -> None:
    logic = VllmPoolConnectorLogic(SPEC, InProcessPool(SPEC), PAGE)
    tokens = list(range(prompt_len))
    table = list(range(100, 100 + 2 * (prompt_len // 8 + 1)))
    computed = min(local_hit_blocks * 8, (prompt_len // 8) * 8)
    if computed:  # the engine already had these blocks (here: loaded from the pool)
        logic.request_hashes("r", tokens)
        logic.update_state_after_alloc("r", table, 0, computed)
    saved: list[bytes] = []
    pages: list[int] = []
    for size in chunks:
        if computed >= prompt_len:
            break
        step = min(size, prompt_len - computed)
        plan = logic.plan_save("r", tokens, table, computed, step)
        if plan is not None:
            saved.extend(plan.hashes)
            pages.extend(plan.page_ids)
        computed += step
    full = computed // 8
    first = min(local_hit_blocks, prompt_len // 8)
    assert saved == logic.pool.hashes(tokens)[first:full]  # type: ignore[attr-defined]
    assert pages == table[2 * first : 2 * full]
