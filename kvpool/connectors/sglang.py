"""SGLang ``HiCacheStorage`` backend: SGLang's host-cache pages stored in the pool.

SGLang names each host page by its own key (a hex hash chain over the page's tokens) and
hands the page as a flat tensor in its host layout. The backend maps each key to a pool hash
``xxh3_128(namespace digest || key)`` (``pool_hash_for_key``) and stores the page bytes as one
pool block of a spec that describes the page as SGLang holds it (``sglang_page_spec``: this
rank's kv heads, ``block_tokens = page_size``, the host layout and TP rank in the revision),
so SGLang pages never share a namespace with canonical blocks written by other engines, and
two SGLang deployments with different TP or layout never read each other's pages.

``KvpoolHiCacheStorage`` (the class SGLang loads) is built on first attribute access by
subclassing the real ``HiCacheStorage``; ``HiCachePoolLogic`` holds every method and is
unit-tested here without SGLang. Nothing was run against a live SGLang (see docs/engine.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from kvpool.connectors.pool_api import BlockPool, pool_spec
from kvpool.core.errors import InvalidArgument
from kvpool.core.spec import KVSpec, Namespace
from kvpool.kernels.paged import TORCH_DTYPES


def sglang_page_spec(
    model: str, num_layers: int, local_kv_heads: int, head_dim: int, dtype: str, page_size: int,
    layout: str, tp_rank: int, tp_size: int, is_mla: bool = False,
) -> KVSpec:  # fmt: skip
    """The KVSpec under which one SGLang rank's host pages are stored (opaque, rank-local)."""
    return KVSpec(
        model=model,
        num_layers=num_layers,
        num_kv_heads=1 if is_mla else local_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        block_tokens=page_size,
        revision=f"sglang-{layout}-tp{tp_rank}of{tp_size}",
        kind="mla" if is_mla else "mha",
    )


def pool_hash_for_key(namespace: Namespace, key: str) -> bytes:
    """SGLang page key -> 16-byte pool hash, scoped by the namespace (tenant salt included)."""
    return xxhash.xxh3_128_digest(namespace.digest() + key.encode("utf-8"))


class HiCachePoolLogic:
    """Every HiCacheStorage method, over a ``BlockPool``; no SGLang import."""

    def __init__(self, pool: BlockPool, spec: KVSpec, salt: bytes = b"") -> None:
        held = pool_spec(pool)
        if held is not None:
            held.require_same(spec, "sglang backend")
        self.pool = pool
        self.spec = spec
        held_ns = getattr(pool, "namespace", None)  # PoolClient's own namespace (its salt) when it has one
        self.namespace = held_ns if isinstance(held_ns, Namespace) else Namespace(spec, salt)
        self.page_elems = spec.block_bytes // spec.dtype_bytes
        self.dtype = TORCH_DTYPES[spec.dtype]

    def _hashes(self, keys: Sequence[str]) -> list[bytes]:
        return [pool_hash_for_key(self.namespace, k) for k in keys]

    def _as_block(self, value: torch.Tensor) -> torch.Tensor:
        if value.numel() != self.page_elems or value.dtype != self.dtype:
            raise InvalidArgument(
                f"page has {value.numel()} x {value.dtype}, the pool spec [{self.spec.describe()}] "
                f"holds {self.page_elems} x {self.dtype}",
                hint="configure the backend with the model's layers, local kv heads, head_dim and page size",
            )
        return value.detach().cpu().contiguous().reshape(1, *self.spec.block_shape)

    def exists(self, key: str) -> bool:
        return self.pool.lookup(self._hashes([key])) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Leading keys present (SGLang's contract), one pool round trip."""
        return self.pool.lookup(self._hashes(keys)) if keys else 0

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value] if value is not None else None, target_location, target_sizes)

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if values is None:
            raise InvalidArgument("zero-copy set (target_locations only) needs SGLang's host pool; pass values")
        if len(values) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys, {len(values)} values")
        if not keys:
            return True
        blocks = torch.cat([self._as_block(v) for v in values])
        self.pool.put(self._hashes(keys), blocks)
        return True

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Pages for the leading present, verified keys; None from the first miss or bad page on."""
        out: list[torch.Tensor | None] = [None] * len(keys)
        if not keys:
            return out
        buf = torch.empty(len(keys), *self.spec.block_shape, dtype=self.dtype)
        got = self.pool.get_into(self._hashes(keys), buf)
        for i in range(got):
            page = buf[i].reshape(-1)
            if target_locations is not None and target_locations[i] is not None:
                target = target_locations[i]
                target.view(-1).copy_(page)
                out[i] = target
            else:
                out[i] = page
        return out


def _build_sglang_class() -> type:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # type: ignore[import-not-found]

    class KvpoolHiCacheStorage(HiCachePoolLogic, HiCacheStorage):  # type: ignore[misc]
        """Constructed by SGLang with a HiCacheStorageConfig; extra_config names the pool."""

        def __init__(self, storage_config: Any, kv_cache: Any = None) -> None:
            from kvpool.client import PoolClient

            extra = storage_config.extra_config or {}
            spec = sglang_page_spec(
                model=storage_config.model_name or "unknown",
                num_layers=int(extra["num_layers"]),
                local_kv_heads=int(extra["local_kv_heads"]),
                head_dim=int(extra["head_dim"]),
                dtype=str(extra.get("dtype", "bfloat16")),
                page_size=int(extra["page_size"]),
                layout="page_first" if storage_config.is_page_first_layout else "layer_first",
                tp_rank=storage_config.tp_rank,
                tp_size=storage_config.tp_size,
                is_mla=storage_config.is_mla_model,
            )
            salt = str(extra.get("salt", "")).encode()
            client = PoolClient.connect(str(extra["pool_address"]), spec, salt=salt)
            HiCachePoolLogic.__init__(self, client, spec, salt)

    return KvpoolHiCacheStorage


_BUILT: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name == "KvpoolHiCacheStorage":
        if name not in _BUILT:
            _BUILT[name] = _build_sglang_class()
        return _BUILT[name]
    raise AttributeError(name)
