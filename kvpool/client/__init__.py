"""Client library for serving engines (sync ``PoolClient`` and asyncio ``AsyncPoolClient``)."""

from kvpool.client.pool_client import PoolClient, PutResult

__all__ = ["PoolClient", "PutResult"]
