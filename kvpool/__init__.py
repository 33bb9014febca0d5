"""kvpool: a global KV-cache pool for LLM serving.

from kvpool import KVSpec, PoolClient

The names below are imported on first use (PEP 562), so that ``import kvpool`` (and the
``kvpool`` command, before it has set up gRPC's logging) does not load gRPC.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.client import AsyncPoolClient, PoolAdmin, PoolClient, PutResult
    from kvpool.core import KVPoolError, KVSpec, Namespace

__all__ = ["AsyncPoolClient", "KVPoolError", "KVSpec", "Namespace", "PoolAdmin", "PoolClient", "PutResult"]
__version__ = "0.1.0"

_HOME = {
    "AsyncPoolClient": "kvpool.client",
    "PoolAdmin": "kvpool.client",
    "PoolClient": "kvpool.client",
    "PutResult": "kvpool.client",
    "KVPoolError": "kvpool.core",
    "KVSpec": "kvpool.core",
    "Namespace": "kvpool.core",
}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
