"""kvpool: a global KV-cache pool for LLM serving.

from kvpool import KVSpec, PoolClient
"""

from kvpool.client import AsyncPoolClient, PoolAdmin, PoolClient, PutResult
from kvpool.core import KVPoolError, KVSpec, Namespace

__all__ = ["AsyncPoolClient", "KVPoolError", "KVSpec", "Namespace", "PoolAdmin", "PoolClient", "PutResult"]
__version__ = "0.1.0"
