"""kvpool: a global KV-cache pool for LLM serving.

from kvpool import KVSpec, PoolClient

The names below are loaded on first use, so ``import kvpool.core.spec`` (or any module of
the lower layers) does not pull in gRPC and the client (``tests/unit/test_layers.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvpool.core.version import VERSION

if TYPE_CHECKING:
    from kvpool.client import AsyncPoolClient, PoolAdmin, PoolClient, PutResult
    from kvpool.core import KVPoolError, KVSpec, Namespace

_LAZY = {
    "AsyncPoolClient": "kvpool.client",
    "PoolAdmin": "kvpool.client",
    "PoolClient": "kvpool.client",
    "PutResult": "kvpool.client",
    "KVPoolError": "kvpool.core",
    "KVSpec": "kvpool.core",
    "Namespace": "kvpool.core",
}

__all__ = ["AsyncPoolClient", "KVPoolError", "KVSpec", "Namespace", "PoolAdmin", "PoolClient", "PutResult"]
__version__ = VERSION


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
