"""The random-weight tiny Llama shared by the Hugging Face connector tests.

Lives next to ``conftest.py`` (``tests/`` is on ``sys.path`` for every test there), so unit and
integration tests import the same model with ``from hf_helpers import tiny_llama``: one
definition means a shape change cannot make two tests quietly test different models.
"""

from __future__ import annotations

from typing import Any

import torch


def tiny_llama(dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """A 2-layer GQA Llama (4 heads, 2 kv heads, head_dim 16) with weights seeded by ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg).to(dtype).eval()


#: Shapes shared by every tiny architecture below: 2 layers, hidden 64, 4 query heads.
_COMMON = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,  # wide enough that logits are far from uniform (argmax flips show)
}

#: arch name -> (transformers config class, model class, config overrides, expected (kv_heads, head_dim))
ARCHS: dict[str, tuple[str, str, dict[str, Any], tuple[int, int]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2}, (2, 16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2}, (2, 16)),
    # Qwen2's own hybrid: layers from max_window_layers on use the sliding window
    "qwen2-sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1},
        (2, 16),
    ),
    # window shorter than the 70-token prompts of the tests
    "mistral-w20": ("MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 2, "sliding_window": 20}, (2, 16)),
    # windows at and just above a block multiple (4 blocks of 16 = 64 tokens)
    "mistral-w64": ("MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 2, "sliding_window": 64}, (2, 16)),
    "mistral-w65": ("MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 2, "sliding_window": 65}, (2, 16)),
    # hybrid: sliding layer 0, full layer 1; head_dim 32 != hidden / heads
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"num_key_value_heads": 2, "head_dim": 32, "sliding_window": 20},
        (2, 32),
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"num_key_value_heads": 1, "head_dim": 32}, (1, 32)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 24}, (2, 24)),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"num_key_value_heads": 2, "pad_token_id": 0, "eos_token_id": 1},
        (2, 16),
    ),
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}, (4, 16)),
    # multi_query: one KV head although the config also carries num_kv_heads=2
    "falcon-mqa": (
        "FalconConfig",
        "FalconForCausalLM",
        {"multi_query": True, "new_decoder_architecture": False},
        (1, 16),
    ),
}


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A random-weight 2-layer model of ``arch`` (a key of ``ARCHS``), weights seeded by ``seed``."""
    import transformers

    config_name, model_name, overrides, _ = ARCHS[arch]
    common = dict(_COMMON)
    if arch == "falcon-mqa":  # Falcon has no intermediate_size / max_position_embeddings knobs
        common.pop("intermediate_size")
        common.pop("max_position_embeddings")
    config = getattr(transformers, config_name)(**common, **overrides)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).to(dtype).eval()
