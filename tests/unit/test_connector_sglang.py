"""SGLang HiCacheStorage logic without SGLang: key mapping, batch semantics, bad pages."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvpool.connectors.pool_api import InProcessPool
from kvpool.connectors.sglang import HiCachePoolLogic, pool_hash_for_key, sglang_page_spec
from kvpool.core.errors import InvalidArgument, SpecMismatch, UnsupportedModel
from kvpool.core.spec import Namespace

SPEC = sglang_page_spec("qwen", 2, 2, 4, "bfloat16", 8, "page_first", 0, 2)


def page(seed: int) -> torch.Tensor:
    return torch.randn(SPEC.block_bytes // 2, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_keys_map_per_namespace_and_salt() -> None:
    a = pool_hash_for_key(Namespace(SPEC, b"t1"), "abc")
    assert len(a) == 16 and a == pool_hash_for_key(Namespace(SPEC, b"t1"), "abc")
    assert a != pool_hash_for_key(Namespace(SPEC, b"t2"), "abc")
    other_tp = sglang_page_spec("qwen", 2, 2, 4, "bfloat16", 8, "page_first", 1, 2)
    assert a != pool_hash_for_key(Namespace(other_tp, b"t1"), "abc")


def test_set_get_exists_batch_semantics() -> None:
    pool = InProcessPool(SPEC, salt=b"s")
    store = HiCachePoolLogic(pool, SPEC, b"s")
    assert store.batch_set(["k0", "k1", "k2"], [page(0), page(1), page(2)])
    assert store.set("k4", page(4))
    assert store.exists("k1") and not store.exists("k3")
    assert store.batch_exists(["k0", "k1", "k2", "k3", "k4"]) == 3
    got = store.batch_get(["k0", "k1", "k3", "k4"])
    assert got[0] is not None and torch.equal(got[0], page(0))
    assert got[1] is not None and torch.equal(got[1], page(1))
    assert got[2] is None and got[3] is None  # from the first miss on: misses
    target = torch.zeros(SPEC.block_bytes // 2, dtype=torch.bfloat16)
    out = store.get("k2", target)
    assert out is target and torch.equal(target, page(2))
    assert store.get("nope") is None


def test_corrupt_page_is_a_miss_and_wrong_pages_refused() -> None:
    pool = InProcessPool(SPEC)
    store = HiCachePoolLogic(pool, SPEC)
    store.batch_set(["a", "b"], [page(0), page(1)])
    pool.corrupt(pool_hash_for_key(Namespace(SPEC), "a"))
    assert store.batch_get(["a", "b"]) == [None, None]
    with pytest.raises(InvalidArgument, match="qwen"):
        store.set("c", page(0).float())
    with pytest.raises(InvalidArgument):
        store.set("c", page(0)[:-1])
    with pytest.raises(SpecMismatch):
        HiCachePoolLogic(InProcessPool(sglang_page_spec("qwen", 2, 2, 4, "bfloat16", 16, "page_first", 0, 2)), SPEC)


def test_glue_through_a_stand_in_hicache_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our KvpoolHiCacheStorage glue against a stand-in base class (not a real SGLang)."""
    import sys
    import types
    from types import SimpleNamespace

    import kvpool.connectors.sglang as adapter
    from kvpool.client import PoolClient

    for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    mod = types.ModuleType("sglang.srt.mem_cache.hicache_storage")

    class HiCacheStorage:  # the real one is an ABC with these abstract methods
        pass

    mod.HiCacheStorage = HiCacheStorage  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(adapter, "_BUILT", {})
    pools: list[InProcessPool] = []

    def connect(cls: object, address: str, spec: object, salt: bytes = b"") -> InProcessPool:
        pools.append(InProcessPool(spec, salt=salt))  # type: ignore[arg-type]
        return pools[-1]

    monkeypatch.setattr(PoolClient, "connect", classmethod(connect))
    config = SimpleNamespace(
        tp_rank=0, tp_size=2, is_mla_model=False, is_page_first_layout=True, model_name="qwen",
        extra_config={"pool_address": "127.0.0.1:1", "num_layers": 2, "local_kv_heads": 2, "head_dim": 4,
                      "dtype": "bfloat16", "page_size": 8, "salt": "s", "model_revision": "w1"},
    )  # fmt: skip
    store: Any = adapter.KvpoolHiCacheStorage(config)
    assert HiCacheStorage in type(store).__mro__
    assert pools[0].spec == sglang_page_spec("qwen", 2, 2, 4, "bfloat16", 8, "page_first", 0, 2, model_revision="w1")
    assert store.batch_set(["x", "y"], [page(1), page(2)])
    assert store.batch_exists(["x", "y", "z"]) == 2
    got = store.get("y")
    assert got is not None and torch.equal(got, page(2))


class MHATokenToKVPoolHost:  # stand-in with the documented attributes of SGLang's host pool
    def __init__(self, **overrides: Any) -> None:
        self.layer_num, self.head_num, self.head_dim, self.page_size = 2, 2, 4, 8
        self.dtype, self.layout = torch.bfloat16, "page_first"
        self.__dict__.update(overrides)


class SWATokenToKVPoolHost(MHATokenToKVPoolHost):
    pass


def test_host_pool_checked_and_hybrid_pools_refused() -> None:
    store = HiCachePoolLogic(InProcessPool(SPEC), SPEC, layout="page_first")
    store.register_mem_pool_host(MHATokenToKVPoolHost())
    for bad in ({"head_num": 4}, {"page_size": 16}, {"dtype": torch.float16}, {"layer_num": 3},
                {"layout": "page_first_direct"}):  # fmt: skip
        with pytest.raises(SpecMismatch, match="host pool"):
            store.register_mem_pool_host(MHATokenToKVPoolHost(**bad))
    with pytest.raises(UnsupportedModel, match="SWATokenToKVPoolHost"):
        store.register_mem_pool_host(SWATokenToKVPoolHost())
    store.register_mem_host_pool_v2(MHATokenToKVPoolHost(), "kv")
    for pool_name in ("swa", "mamba", "indexer"):
        with pytest.raises(UnsupportedModel, match=pool_name):
            store.register_mem_host_pool_v2(MHATokenToKVPoolHost(), pool_name)


def test_weights_and_ranks_separate_namespaces() -> None:
    def spec(**kw: Any) -> Any:
        return sglang_page_spec("qwen", 2, 2, 4, "bfloat16", 8, "page_first", 0, 2, **kw)

    digests = {
        spec(model_revision="w1").digest(),
        spec(model_revision="w2").digest(),
        spec(model_revision="w1", pp_rank=1, pp_size=2).digest(),
        spec(model_revision="w1", pp_rank=0, pp_size=2).digest(),
        spec(model_revision="w1", cp_rank=1, cp_size=2).digest(),
    }
    assert len(digests) == 5


def test_glue_refuses_missing_revision_and_split_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types
    from types import SimpleNamespace

    import kvpool.connectors.sglang as adapter
    from kvpool.client import PoolClient

    for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    mod = types.ModuleType("sglang.srt.mem_cache.hicache_storage")
    mod.HiCacheStorage = type("HiCacheStorage", (), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(adapter, "_BUILT", {})
    monkeypatch.setattr(PoolClient, "connect", classmethod(lambda cls, a, spec, salt=b"": InProcessPool(spec)))
    extra = {"pool_address": "127.0.0.1:1", "num_layers": 2, "local_kv_heads": 2, "head_dim": 4, "page_size": 8}

    def config(**kw: Any) -> SimpleNamespace:
        base = {"tp_rank": 0, "tp_size": 1, "is_mla_model": False, "is_page_first_layout": True, "model_name": "q"}
        return SimpleNamespace(**{**base, **kw})

    with pytest.raises(InvalidArgument, match="model_revision"):
        adapter.KvpoolHiCacheStorage(config(extra_config=extra))
    with pytest.raises(UnsupportedModel, match="should_split_heads"):
        adapter.KvpoolHiCacheStorage(config(extra_config={**extra, "model_revision": "w"}, should_split_heads=True))
    with pytest.raises(UnsupportedModel, match="SWATokenToKVPoolHost"):
        adapter.KvpoolHiCacheStorage(config(extra_config={**extra, "model_revision": "w"}), SWATokenToKVPoolHost())
    store: Any = adapter.KvpoolHiCacheStorage(
        config(extra_config={**extra, "model_revision": "w"}, pp_rank=1, pp_size=2), MHATokenToKVPoolHost()
    )
    assert store.spec.revision == "w+sglang-page_first-tp0of1-pp1of2"


class LeaseOutlivedPool(InProcessPool):
    """Hands every held block to the engine, then says none counted (``PoolClient.read_with``
    when the read outlived its lease: the runs were verified and copied, but are misses)."""

    def read_with(self, hashes: Any, use: Any) -> int:
        super().read_with(hashes, use)
        return 0


def test_pages_a_read_handed_over_but_did_not_count_are_misses() -> None:
    pool = LeaseOutlivedPool(SPEC, salt=b"s")
    store = HiCachePoolLogic(pool, SPEC, b"s")
    store.batch_set(["a", "b"], [page(0), page(1)])
    assert store.batch_get(["a", "b"]) == [None, None]
    target = torch.zeros(SPEC.block_bytes // 2, dtype=torch.bfloat16)
    assert store.get("a", target) is None  # the bytes may be in target: not a hit all the same
