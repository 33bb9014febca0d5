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
