"""kvpool: a global KV-cache pool for LLM serving.

    from kvpool import KVSpec, PoolClient
"""

from kvpool.client import PoolClient, PutResult
from kvpool.core import KVPoolError, KVSpec, Namespace

__all__ = ["KVPoolError", "KVSpec", "Namespace", "PoolClient", "PutResult"]
__version__ = "0.1.0"
