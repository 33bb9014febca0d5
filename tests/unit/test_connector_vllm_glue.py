"""The KvpoolConnector glue driven through a stand-in of vLLM's KVConnectorBase_V1 module.

The stand-in mirrors only what the glue touches, as read from vLLM's
``kv_connector/v1/base.py``; it checks our glue code paths, NOT compatibility with a real
vLLM (see docs/engine.md).
"""

from __future__ import annotations

import enum
import sys
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvpool.connectors.vllm as vllm_adapter
from kvpool.client import PoolClient
from kvpool.connectors.pool_api import InProcessPool
from kvpool.core.spec import KVSpec

torch.set_num_threads(1)


class _Role(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class _Metadata:
    pass


class _Base:
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        self._connector_metadata: Any = None
        self._role = role

    def bind_connector_metadata(self, metadata: Any) -> None:
        self._connector_metadata = metadata

    def _get_connector_metadata(self) -> Any:
        assert self._connector_metadata is not None
        return self._connector_metadata


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[InProcessPool]:
    names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector"]
    names.append("vllm.distributed.kv_transfer.kv_connector.v1")
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
    base.KVConnectorBase_V1 = _Base  # type: ignore[attr-defined]
    base.KVConnectorMetadata = _Metadata  # type: ignore[attr-defined]
    base.KVConnectorRole = _Role  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, base.__name__, base)
    monkeypatch.setattr(vllm_adapter, "_BUILT", {})
    spec = KVSpec("m", 2, 2, 4, "float32", 8)
    pool = InProcessPool(spec, salt=b"t")
    monkeypatch.setattr(PoolClient, "connect", classmethod(lambda cls, address, spec, salt=b"": pool))
    yield pool


def _config() -> Any:
    model = SimpleNamespace(
        model="m",
        revision=None,
        dtype=torch.float32,
        get_num_layers=lambda pc: 2,
        get_total_num_kv_heads=lambda: 2,
        get_head_size=lambda: 4,
    )
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"pool_address": "127.0.0.1:1", "salt": "t", "block_tokens": 8}
        ),
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, rank=0),
        cache_config=SimpleNamespace(block_size=4),
    )


def _output(new: list[Any], cached: list[tuple[str, int]], scheduled: dict[str, int]) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            new_block_ids=[None for _ in cached],
            num_computed_tokens=[c for _, c in cached],
        ),
        num_scheduled_tokens=scheduled,
    )


def test_chunked_producer_then_consumer_through_the_glue(fake_vllm: InProcessPool) -> None:
    cls = vllm_adapter.KvpoolConnector
    scheduler, worker = cls(_config(), _Role.SCHEDULER), cls(_config(), _Role.WORKER)
    gen = torch.Generator().manual_seed(0)
    src = {f"model.layers.{i}.attn": torch.randn(2, 12, 4, 2, 4, generator=gen) for i in range(2)}
    worker.register_kv_caches(src)
    prompt = list(range(21))
    req_a = SimpleNamespace(request_id="a", prompt_token_ids=prompt, num_computed_tokens=0)
    assert scheduler.get_num_new_matched_tokens(req_a, 0) == (0, False)
    scheduler.update_state_after_alloc(req_a, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    table_a = [4, 0, 6, 2, 9, 11]
    new = SimpleNamespace(req_id="a", prompt_token_ids=prompt, block_ids=(table_a,), num_computed_tokens=0)
    for out in (_output([new], [], {"a": 12}), _output([], [("a", 12)], {"a": 9}), _output([], [("a", 21)], {"a": 1})):
        worker.bind_connector_metadata(scheduler.build_connector_meta(out))
        worker.start_load_kv(None)
        worker.wait_for_save()
    assert fake_vllm.lookup(fake_vllm.hashes(prompt)) == 2  # both full blocks, the second from chunk 2
    assert scheduler.request_finished(req_a, table_a) == (False, None)

    consumer_sched, consumer = cls(_config(), _Role.SCHEDULER), cls(_config(), _Role.WORKER)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    consumer.register_kv_caches(dst)
    req_b = SimpleNamespace(request_id="b", prompt_token_ids=prompt, num_computed_tokens=0)
    assert consumer_sched.get_num_new_matched_tokens(req_b, 0) == (16, False)
    table_b = [1, 3, 5, 7, 8, 10]
    consumer_sched.update_state_after_alloc(req_b, SimpleNamespace(get_block_ids=lambda: (table_b,)), 16)
    new_b = SimpleNamespace(req_id="b", prompt_token_ids=prompt, block_ids=(table_b,), num_computed_tokens=16)
    consumer.bind_connector_metadata(consumer_sched.build_connector_meta(_output([new_b], [], {"b": 5})))
    consumer.start_load_kv(None)
    consumer.wait_for_layer_load("model.layers.0.attn")
    consumer.wait_for_save()
    assert consumer.get_block_ids_with_load_errors() == set()
    assert consumer.get_finished({"b"}) == (None, None)
    for name in src:
        for pa, pb in zip(table_a[:4], table_b[:4]):
            assert torch.equal(dst[name][:, pb], src[name][:, pa])
