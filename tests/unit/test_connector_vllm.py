"""vLLM adapter logic without vLLM: vLLM 0.32's [B, H, N, C] caches in both content packings,
block tables -> pool blocks, kernel-block splits, load errors, TP saves, save planning.

The caches are built the way vLLM 0.32 hands them to a connector (one ``[B, H, N, C]`` view
per layer, C = K|V of head_size); the byte oracle reads K and V the way the backends do
(``CPU_ATTN``: view as ``[B, H, 2N, D]`` and chunk dim 2; FlashAttention: transpose and
split the content). The same logic runs inside real vLLM in tests/vllm/.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.connectors.pool_api import InProcessPool
from kvpool.connectors.vllm import (
    BackgroundSaver,
    ConnectorStats,
    VllmPoolConnectorLogic,
    layer_order,
    pages_for_blocks,
)
from kvpool.connectors.vllm_layout import describe_caches, kv_view, manager_to_kernel_pages
from kvpool.core.errors import CapacityExhausted, InvalidArgument, SpecMismatch
from kvpool.core.spec import KVSpec

torch.set_num_threads(1)
SPEC = KVSpec("m", 2, 2, 4, "float32", 8)  # pool blocks of 8 tokens = 2 vLLM blocks of 4
PAGE = 4
BACKENDS = ["CPU_ATTN", "FLASH_ATTN"]


def caches(seed: int, pages: int = 16, heads: int = 2, page: int = PAGE) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (pages, heads, page, 2 * SPEC.head_dim)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(*shape, generator=gen) for i in (1, 0)}


def k_and_v(cache: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H, N, D] K and V exactly as the backend reads them (the oracle)."""
    b, h, n, c = cache.shape
    if backend == "CPU_ATTN":
        k, v = cache.view(b, h, 2 * n, c // 2).chunk(2, dim=2)
        return k, v
    k, v = cache.split(c // 2, dim=-1)
    return k, v


_BUILT_HERE: list[VllmPoolConnectorLogic] = []  # every connector the running test built


def new_logic(spec: KVSpec, pool: InProcessPool, page: int, **kw: object) -> VllmPoolConnectorLogic:
    """A connector that ``shutdown_connectors`` stops when the test ends (its saver thread
    starts with ``register_kv_caches`` and would otherwise outlive the test)."""
    logic = VllmPoolConnectorLogic(spec, pool, page, **kw)  # type: ignore[arg-type]
    _BUILT_HERE.append(logic)
    return logic


@pytest.fixture(autouse=True)
def shutdown_connectors() -> Iterator[None]:
    """Stop every connector the test built; no saver thread it started may be left."""
    before = set(threading.enumerate())
    yield
    while _BUILT_HERE:
        _BUILT_HERE.pop().shutdown()
    left = [t.name for t in threading.enumerate() if t not in before and t.name == "kvpool-vllm-saver"]
    assert left == [], "a connector built without new_logic() was not shut down"


def connected(backend: str, pool: InProcessPool, kv: dict[str, torch.Tensor], **kw: object) -> VllmPoolConnectorLogic:
    logic = new_logic(SPEC, pool, PAGE, **kw)
    logic.register_kv_caches(kv, backend)
    return logic


def test_layer_order_and_pages_for_blocks() -> None:
    assert layer_order(["model.layers.10.attn", "model.layers.2.attn"]) == [
        "model.layers.2.attn",
        "model.layers.10.attn",
    ]
    assert pages_for_blocks([7, 3, 9, 1, 5, 2], 1, 2, 2) == [9, 1, 5, 2]
    with pytest.raises(InvalidArgument):
        pages_for_blocks([7, 3], 1, 1, 2)
    assert manager_to_kernel_pages([3, 0], 2) == [6, 7, 0, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_view_reads_k_and_v_as_the_backend_does(backend: str) -> None:
    cache = caches(5)["model.layers.0.self_attn.attn"]
    layout = describe_caches(backend, [cache], 16, SPEC.head_dim)
    view = kv_view(cache, layout)
    k, v = k_and_v(cache, backend)
    assert view.data_ptr() == cache.data_ptr()  # a view, no copy
    assert torch.equal(view[0], k) and torch.equal(view[1], v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_producer_saves_then_consumer_loads_same_kv(backend: str) -> None:
    pool = InProcessPool(SPEC)
    tokens = list(range(21))  # 2 full pool blocks + 5 tokens
    src = caches(1)
    producer = connected(backend, pool, src)
    assert producer.get_num_new_matched_tokens("a", tokens, 0) == (0, False)
    table_a = [4, 0, 6, 2, 9, 11]
    save1 = producer.plan_save("a", tokens, table_a, 0, 12)  # chunk 1: 12 tokens -> block 0 complete
    save2 = producer.plan_save("a", tokens, table_a, 12, 9)  # chunk 2: to 21 -> block 1 complete
    assert save1 is not None and save2 is not None
    assert (save1.page_ids, save2.page_ids) == ((4, 0), (6, 2))
    assert producer.plan_save("a", tokens, table_a, 21, 1) is None  # decode tokens are not saved
    producer.wait_for_save(producer.build_connector_meta([save1, save2]))
    assert producer.drain_saves()
    assert producer.request_finished("a") == (False, None)
    assert producer.stats.saved_blocks == 2

    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    consumer = connected(backend, pool, dst)
    assert consumer.get_num_new_matched_tokens("b", tokens, 8) == (8, False)  # vLLM had block 0 locally
    assert consumer.get_num_new_matched_tokens("b", tokens, 4) == (0, False)  # local hit ends mid pool block
    assert consumer.get_num_new_matched_tokens("b", tokens, 0) == (16, False)
    table_b = [1, 3, 5, 7, 8, 10]
    consumer.update_state_after_alloc("b", table_b, 16)
    consumer.start_load_kv(consumer.build_connector_meta([]))
    assert consumer.get_block_ids_with_load_errors() == set()
    for name in src:
        for a_page, b_page in zip(table_a[:4], table_b[:4]):
            assert torch.equal(dst[name][b_page], src[name][a_page])
        assert torch.equal(dst[name][8], torch.zeros(2, PAGE, 2 * SPEC.head_dim))  # nothing past the hit
    producer.shutdown()
    consumer.shutdown()


def test_load_starts_after_vllms_own_prefix_hit() -> None:
    """vLLM's local hit covers pool block 0: only block 1 is loaded, into the pages after it."""
    pool = InProcessPool(SPEC)
    tokens = list(range(21))
    src = caches(6)
    producer = connected("CPU_ATTN", pool, src)
    plan = producer.plan_save("a", tokens, [0, 1, 2, 3, 4, 5], 0, 21)
    assert plan is not None
    producer.wait_for_save(producer.build_connector_meta([plan]))
    assert producer.drain_saves()
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    consumer = connected("CPU_ATTN", pool, dst)
    assert consumer.get_num_new_matched_tokens("b", tokens, 8) == (8, False)
    consumer.update_state_after_alloc("b", [9, 10, 11, 12, 13, 14], 8)
    meta = consumer.build_connector_meta([])
    assert [load.page_ids for load in meta.loads] == [(11, 12)]
    consumer.start_load_kv(meta)
    for name in src:
        assert torch.equal(dst[name][11], src[name][2]) and torch.equal(dst[name][12], src[name][3])
        assert torch.equal(dst[name][9], torch.zeros_like(dst[name][9]))  # vLLM's own pages untouched
    assert consumer.get_num_new_matched_tokens("c", tokens, 0) == (16, False)
    with pytest.raises(InvalidArgument):  # vLLM can never accept more than was offered
        consumer.update_state_after_alloc("c", [1, 2, 3, 4, 5, 6], 24)
    assert consumer.get_num_new_matched_tokens("d", tokens, 0) == (16, False)
    consumer.update_state_after_alloc("d", [1, 2, 3, 4, 5, 6], 8)  # fewer, block-aligned: loads those
    assert [load.page_ids for load in consumer.build_connector_meta([]).loads] == [(1, 2)]


def test_kernel_blocks_smaller_than_vllms_block() -> None:
    """vLLM splits each block of 4 tokens into 2 kernel pages of 2 tokens: ids map b -> 2b, 2b+1."""
    pool = InProcessPool(SPEC)
    tokens = list(range(9))
    src = caches(7, pages=32, page=2)
    producer = new_logic(SPEC, pool, PAGE)
    layout = producer.register_kv_caches(src, "FLASH_ATTN", num_blocks=16)
    assert (layout.page_tokens, layout.pages_per_manager_block) == (2, 2)
    plan = producer.plan_save("a", tokens, [5, 3], 0, 9)
    assert plan is not None
    producer.wait_for_save(producer.build_connector_meta([plan]))
    assert producer.drain_saves()
    got = torch.empty(1, *SPEC.block_shape)
    assert pool.get_into(pool.hashes(tokens), got) == 1
    for layer, name in enumerate(layer_order(list(src))):
        k, v = k_and_v(src[name], "FLASH_ATTN")
        for slot, page in enumerate([10, 11, 6, 7]):  # block ids 5, 3 -> kernel pages
            tok = slice(2 * slot, 2 * slot + 2)
            assert torch.equal(got[0, layer, 0, :, tok], k[page])
            assert torch.equal(got[0, layer, 1, :, tok], v[page])


def test_failed_block_reported_as_load_error_for_exactly_its_pages() -> None:
    pool = InProcessPool(SPEC)
    tokens = list(range(30))
    writer = connected("CPU_ATTN", pool, caches(2))
    plan = writer.plan_save("w", tokens, list(range(8)), 0, 30)
    assert plan is not None
    writer.wait_for_save(writer.build_connector_meta([plan]))
    assert writer.drain_saves()
    reader = connected("CPU_ATTN", pool, {k: torch.zeros_like(v) for k, v in caches(0).items()})
    assert reader.get_num_new_matched_tokens("r", tokens, 0) == (24, False)
    pool.corrupt(pool.hashes(tokens)[1])  # corrupted after the lookup, before the load
    reader.update_state_after_alloc("r", [10, 11, 12, 13, 14, 15, 3, 2], 24)
    reader.start_load_kv(reader.build_connector_meta([]))
    assert reader.get_block_ids_with_load_errors() == {12, 13, 14, 15}  # blocks 1 and 2 -> pages
    assert reader.get_block_ids_with_load_errors() == set()  # reported once
    assert (reader.stats.load_blocks, reader.stats.load_failed_blocks) == (1, 2)


def test_unknown_backend_and_mismatched_caches_are_refused() -> None:
    pool = InProcessPool(SPEC)
    src = caches(3)
    with pytest.raises(SpecMismatch, match="FLASHMLA"):
        new_logic(SPEC, pool, PAGE).register_kv_caches(src, "FLASHMLA")
    with pytest.raises(SpecMismatch):  # dtype differs from the pool spec
        new_logic(SPEC, pool, PAGE).register_kv_caches({k: v.to(torch.bfloat16) for k, v in src.items()}, "CPU_ATTN")
    with pytest.raises(SpecMismatch, match="content"):  # C is not K|V of head_size (e.g. scales appended)
        new_logic(SPEC, pool, PAGE).register_kv_caches(
            {k: torch.zeros(16, 2, PAGE, 2 * SPEC.head_dim + 2) for k in src}, "FLASH_ATTN"
        )
    with pytest.raises(SpecMismatch, match="strides"):  # a page-packed cache must keep each page contiguous
        wide = torch.zeros(16, 2, PAGE, 4 * SPEC.head_dim)
        new_logic(SPEC, pool, PAGE).register_kv_caches({k: wide[..., : 2 * SPEC.head_dim] for k in src}, "CPU_ATTN")
    with pytest.raises(InvalidArgument):
        new_logic(SPEC, pool, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp_reader_loads_only_its_heads(backend: str) -> None:
    pool = InProcessPool(SPEC)
    tokens = list(range(9))
    src = caches(3)
    writer = connected(backend, pool, src)
    plan = writer.plan_save("w", tokens, [0, 1, 2], 0, 9)
    assert plan is not None
    writer.wait_for_save(writer.build_connector_meta([plan]))
    assert writer.drain_saves()
    for rank in range(2):
        mine = {k: torch.zeros(16, 1, PAGE, 2 * SPEC.head_dim) for k in src}
        reader = connected(backend, pool, mine, tp_rank=rank, tp_size=2)
        assert reader.get_num_new_matched_tokens("r", tokens, 0) == (8, False)
        reader.update_state_after_alloc("r", [5, 6, 7], 8)
        reader.start_load_kv(reader.build_connector_meta([]))
        for name in src:
            assert torch.equal(mine[name][5:7], src[name][0:2, rank : rank + 1])
        with pytest.raises(InvalidArgument):  # no head_allgather given
            reader.wait_for_save(reader.build_connector_meta([plan]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_writer_saves_whole_blocks_through_head_allgather(backend: str) -> None:
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
    ranks: list[VllmPoolConnectorLogic] = []

    def rank_main(rank: int) -> None:
        try:
            mine = {k: v[:, rank : rank + 1].clone() for k, v in full.items()}
            logic = connected(backend, pool, mine, tp_rank=rank, tp_size=2, head_allgather=allgather_for(rank))
            ranks.append(logic)
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
    assert all(r.drain_saves() for r in ranks)
    reference = InProcessPool(SPEC)
    tp1 = connected(backend, reference, full)
    plan = tp1.plan_save("w", tokens, [3, 1, 0, 2, 5], 0, 17)
    assert plan is not None
    tp1.wait_for_save(tp1.build_connector_meta([plan]))
    assert tp1.drain_saves()
    hashes = pool.hashes(tokens)
    a = torch.empty(2, *SPEC.block_shape)
    b = torch.empty(2, *SPEC.block_shape)
    assert pool.get_into(hashes, a) == 2 and reference.get_into(hashes, b) == 2
    assert torch.equal(a, b)  # TP=2 ranks together stored exactly what TP=1 stores


def test_full_save_queue_drops_saves_and_counts_them() -> None:
    pool = InProcessPool(SPEC)
    logic = new_logic(SPEC, pool, PAGE, max_pending_save_bytes=SPEC.block_bytes - 1)
    logic.register_kv_caches(caches(8), "CPU_ATTN")
    plan = logic.plan_save("w", list(range(9)), [0, 1, 2], 0, 9)
    assert plan is not None
    logic.wait_for_save(logic.build_connector_meta([plan]))
    assert logic.drain_saves()
    assert (logic.stats.saved_blocks, logic.stats.dropped_save_blocks) == (0, 1)
    assert pool.lookup(pool.hashes(list(range(9)))) == 0
    logic.shutdown()


@settings(max_examples=60, deadline=None)
@given(
    prompt_len=st.integers(1, 60),
    chunks=st.lists(st.integers(1, 20), min_size=1, max_size=12),
    local_hit_blocks=st.integers(0, 3),
)
def test_chunked_schedule_saves_each_full_prompt_block_once_in_order(
    prompt_len: int, chunks: list[int], local_hit_blocks: int
) -> None:
    logic = new_logic(SPEC, InProcessPool(SPEC), PAGE)
    tokens = list(range(prompt_len))
    table = list(range(100, 100 + 2 * (prompt_len // 8 + 1)))
    computed = min(local_hit_blocks * 8, ((prompt_len - 1) // 8) * 8)  # vLLM always computes the last token
    logic.get_num_new_matched_tokens("r", tokens, computed)  # vLLM's own prefix cache had these
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
    # the pool is empty, so every full block is saved, also those vLLM had locally
    first = 0
    assert saved == logic.pool.hashes(tokens)[first:full]  # type: ignore[attr-defined]
    assert pages == table[2 * first : 2 * full]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mqa_one_kv_head(backend: str) -> None:
    spec = KVSpec("mqa", 2, 1, 4, "float32", 8)
    pool = InProcessPool(spec)
    gen = torch.Generator().manual_seed(9)
    src = {f"model.layers.{i}.attn": torch.randn(8, 1, PAGE, 8, generator=gen) for i in range(2)}
    producer = new_logic(spec, pool, PAGE)
    producer.register_kv_caches(src, backend)
    plan = producer.plan_save("a", list(range(17)), [3, 1, 6, 0, 2], 0, 17)
    assert plan is not None
    producer.wait_for_save(producer.build_connector_meta([plan]))
    assert producer.drain_saves()
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    consumer = new_logic(spec, pool, PAGE)
    consumer.register_kv_caches(dst, backend)
    assert consumer.get_num_new_matched_tokens("b", list(range(17)), 0) == (16, False)
    consumer.update_state_after_alloc("b", [4, 5, 7, 2, 0], 16)
    consumer.start_load_kv(consumer.build_connector_meta([]))
    for name in src:
        assert torch.equal(dst[name][[4, 5, 7, 2]], src[name][[3, 1, 6, 0]])


def test_a_save_the_pool_refuses_to_stage_is_dropped_and_counted_not_raised() -> None:
    """PutStart refused on the engine step (pool full, tenant busy, permission): the save is
    a lost cache entry, counted; it never reaches the engine as an error (which would make
    the worker stop using the pool for good), and the saver takes the next save."""
    spec = KVSpec("m", 2, 2, 8, "float16", 16)
    pool = InProcessPool(spec)
    stats = ConnectorStats()
    saver = BackgroundSaver(pool, 1 << 20, stats)
    try:
        hashes = pool.hashes(list(range(32)))

        def refused() -> None:
            raise CapacityExhausted("the pool is full")

        assert saver.submit(hashes, spec.block_bytes * 2, refused) is False
        assert stats.dropped_save_blocks == 2 and saver.drain(5.0)

        def broken() -> None:
            raise RuntimeError("a bug of ours")

        with pytest.raises(RuntimeError):  # not a pool refusal: still the worker's to handle
            saver.submit(hashes, spec.block_bytes * 2, broken)
        assert saver.drain(5.0)
    finally:
        saver.stop()
