"""Client library for serving engines (sync ``PoolClient`` and asyncio ``AsyncPoolClient``)."""

from kvpool.client.admin import PoolAdmin
from kvpool.client.async_client import AsyncPoolClient
from kvpool.client.pool_client import PoolClient
from kvpool.client.pool_common import PutResult

__all__ = ["AsyncPoolClient", "PoolAdmin", "PoolClient", "PutResult"]
