"""SGLang ``HiCacheStorage`` backend: SGLang's host-cache pages stored in the pool.

SGLang names each host page by its own key (a hex hash chain over the page's tokens) and
hands the page as a flat tensor in its host layout. The backend maps each key to a pool hash
``xxh3_128(namespace digest || key)`` (``pool_hash_for_key``) and stores the page bytes as one
pool block of a spec that describes the page as SGLang holds it (``sglang_page_spec``: this
rank's kv heads, ``block_tokens = page_size``, the host layout and TP rank in the revision),
so SGLang pages never share a namespace with canonical blocks written by other engines, and
two SGLang deployments with different TP or layout never read each other's pages.

What is refused, and why (issue 11: never store or serve KV that is not the prompt's):

* no ``model_revision`` in ``extra_config``: SGLang's page keys hash tokens only, and the
  backend never sees the weights, so without a revision that names the exact weights (a hub
  commit hash, or ``kvpool.connectors.fingerprint.module_fingerprint(model)`` computed on the
  serving process) two deployments of one model name with other weights would share pages;
* a host pool other than SGLang's plain MHA / MLA host pools (``register_mem_pool_host``), or
  any extra pool of the v2 interface (``register_mem_host_pool_v2`` with SWA, Mamba, indexer,
  ... pools): hybrid and sliding-window models keep per-pool state this backend does not store;
* a host pool whose layers, heads, head_dim, page size, dtype or layout differ from the spec;
* ``should_split_heads`` (pages split across a TP width other than this rank's).

Pipeline- and context-parallel ranks hold other layers / other slices of a page, so their
rank is part of the spec revision (they never read each other's pages); data-parallel
replicas hold identical pages and share them.

``KvpoolHiCacheStorage`` (the class SGLang loads) is built on first attribute access by
subclassing the real ``HiCacheStorage``; ``HiCachePoolLogic`` holds every method and is
unit-tested here without SGLang. Nothing was run against a live SGLang (see docs/engine.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from kvpool.connectors.paged_io import load_blocks, stage_blocks
from kvpool.connectors.pool_api import BlockPool, pool_spec
from kvpool.core.errors import InvalidArgument, SpecMismatch, UnsupportedModel
from kvpool.core.spec import KVSpec, Namespace
from kvpool.kernels.paged import TORCH_DTYPES

#: SGLang host pools (``sglang.srt.mem_cache.pool_host``) whose pages are one plain KV page.
SUPPORTED_HOST_POOLS = ("MHATokenToKVPoolHost", "MLATokenToKVPoolHost")

#: v2 pool names this backend stores (``PoolName.KV``); every other pool is refused.
SUPPORTED_V2_POOLS = ("kv",)


def sglang_page_spec(
    model: str, num_layers: int, local_kv_heads: int, head_dim: int, dtype: str, page_size: int,
    layout: str, tp_rank: int, tp_size: int, is_mla: bool = False, *, model_revision: str = "",
    pp_rank: int = 0, pp_size: int = 1, cp_rank: int = 0, cp_size: int = 1,
) -> KVSpec:  # fmt: skip
    """The KVSpec under which one SGLang rank's host pages are stored (opaque, rank-local).

    The revision names the weights (``model_revision``), the host layout and the TP / PP / CP
    rank: pages of other weights, layouts or ranks never share a namespace.
    """
    rank = f"tp{tp_rank}of{tp_size}"
    if pp_size > 1:
        rank += f"-pp{pp_rank}of{pp_size}"
    if cp_size > 1:
        rank += f"-cp{cp_rank}of{cp_size}"
    layout_rank = f"sglang-{layout}-{rank}"
    return KVSpec(
        model=model,
        num_layers=num_layers,
        num_kv_heads=1 if is_mla else local_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        block_tokens=page_size,
        revision=f"{model_revision}+{layout_rank}" if model_revision else layout_rank,
        kind="mla" if is_mla else "mha",
    )


def pool_hash_for_key(namespace: Namespace, key: str) -> bytes:
    """SGLang page key -> 16-byte pool hash, scoped by the namespace (tenant salt included)."""
    return xxhash.xxh3_128_digest(namespace.digest() + key.encode("utf-8"))


class HiCachePoolLogic:
    """Every HiCacheStorage method, over a ``BlockPool``; no SGLang import."""

    def __init__(self, pool: BlockPool, spec: KVSpec, salt: bytes = b"", layout: str | None = None) -> None:
        """``pool``: a ``BlockPool`` of ``spec``'s blocks; ``salt``: the tenant salt when the pool has no
        namespace of its own; ``layout``: SGLang's host-pool layout, taken from the registered host pool when
        None.
        """
        held = pool_spec(pool)
        if held is not None:
            held.require_same(spec, "sglang backend")
        self.pool = pool
        self.spec = spec
        held_ns = getattr(pool, "namespace", None)  # PoolClient's own namespace (its salt) when it has one
        self.namespace = held_ns if isinstance(held_ns, Namespace) else Namespace(spec, salt)
        self.page_elems = spec.block_bytes // spec.dtype_bytes
        self.dtype = TORCH_DTYPES[spec.dtype]
        self.layout = layout
        self.mem_pool_host: Any = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host KV pool: refuse one whose pages are not what the spec says.

        Checked by its documented attributes (``layer_num``, ``head_num``, ``head_dim``,
        ``page_size``, ``dtype``, ``layout``; MLA: ``kv_lora_rank + qk_rope_head_dim``).
        """
        kind = type(mem_pool_host).__name__
        if kind not in SUPPORTED_HOST_POOLS:
            raise UnsupportedModel(
                f"SGLang host pool {kind} is not supported (supported: {list(SUPPORTED_HOST_POOLS)})",
                hint="hybrid / sliding-window models keep state this backend does not store: "
                "run them without the kvpool storage backend",
            )
        mla = kind == "MLATokenToKVPoolHost"
        width = (
            getattr(mem_pool_host, "kv_lora_rank", 0) + getattr(mem_pool_host, "qk_rope_head_dim", 0)
            if mla
            else getattr(mem_pool_host, "head_dim", None)
        )
        dtype = getattr(mem_pool_host, "dtype", None)
        host = {
            "layers": getattr(mem_pool_host, "layer_num", None),
            "kv_heads": 1 if mla else getattr(mem_pool_host, "head_num", None),
            "head_dim": width,
            "page_size": getattr(mem_pool_host, "page_size", None),
            "dtype": dtype,
        }
        want = {
            "layers": self.spec.num_layers,
            "kv_heads": self.spec.num_kv_heads,
            "head_dim": self.spec.head_dim,
            "page_size": self.spec.block_tokens,
            "dtype": self.dtype,
        }
        if self.layout is not None and getattr(mem_pool_host, "layout", self.layout) != self.layout:
            host["layout"], want["layout"] = mem_pool_host.layout, self.layout
        if host != want or (mla != (self.spec.kind == "mla")):
            raise SpecMismatch(
                f"SGLang host pool {kind} holds {host}, the pool spec [{self.spec.describe()}] holds {want}",
                hint="configure extra_config with this rank's layers, local kv heads, head_dim, dtype and page size",
            )
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """v2 interface: only the plain KV pool; SWA / Mamba / indexer pools are refused."""
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name not in SUPPORTED_V2_POOLS:
            raise UnsupportedModel(
                f"SGLang pool {name!r} is not supported: this backend stores plain KV pages only",
                hint="hybrid (SWA / Mamba / sparse) models need a backend that stores every pool; "
                "run them without the kvpool storage backend",
            )
        self.register_mem_pool_host(host_pool)

    def _hashes(self, keys: Sequence[str]) -> list[bytes]:
        return [pool_hash_for_key(self.namespace, k) for k in keys]

    def _as_block(self, value: torch.Tensor) -> torch.Tensor:
        if value.numel() != self.page_elems or value.dtype != self.dtype:
            raise InvalidArgument(
                f"page has {value.numel()} x {value.dtype}, the pool spec [{self.spec.describe()}] "
                f"holds {self.page_elems} x {self.dtype}",
                hint="configure the backend with the model's layers, local kv heads, head_dim and page size",
            )
        return value.detach().reshape(self.spec.block_shape)  # a view where the page is contiguous

    def exists(self, key: str) -> bool:
        """Whether the page named by ``key`` is in the pool."""
        return self.pool.lookup(self._hashes([key])) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Leading keys present (SGLang's contract), one pool round trip."""
        return self.pool.lookup(self._hashes(keys)) if keys else 0

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one page (HiCacheStorage.set); True when it is in the pool afterwards."""
        return self.batch_set([key], [value] if value is not None else None, target_location, target_sizes)

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store pages (HiCacheStorage.batch_set); True when every one is in the pool afterwards."""
        if values is None:
            raise InvalidArgument("zero-copy set (target_locations only) needs SGLang's host pool; pass values")
        if len(values) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys, {len(values)} values")
        if not keys:
            return True
        pages = [self._as_block(v) for v in values]  # every page checked before anything is written

        def to_slots(first: int, count: int, out: torch.Tensor) -> None:
            for k in range(count):  # each page straight into its arena slot (from any device)
                out[k].copy_(pages[first + k])

        staged = stage_blocks(self.pool, self.spec, self.dtype, self._hashes(keys), to_slots)
        if staged is not None:
            staged.commit()
        return True

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """One page as a tensor, or None on a miss (HiCacheStorage.get)."""
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Pages for the leading present, verified keys; None from the first miss or bad page on."""
        out: list[torch.Tensor | None] = [None] * len(keys)
        if not keys:
            return out

        def to_pages(first: int, count: int, blocks: torch.Tensor) -> None:
            # verified pages go straight from the arena into SGLang's host pages (or a new tensor)
            for k in range(count):
                i, page = first + k, blocks[k].reshape(-1)
                target = target_locations[i] if target_locations is not None else None
                if target is not None:
                    target.view(-1).copy_(page)
                    out[i] = target
                else:
                    out[i] = page.clone()

        got = load_blocks(self.pool, self.spec, self.dtype, self._hashes(keys), to_pages)
        # pages handed over past ``got`` are not hits: a read that outlived its lease counts
        # as all misses although its runs were verified and copied (PoolClient.read_with)
        for i in range(got, len(keys)):
            out[i] = None
        return out


def _build_sglang_class() -> type:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # type: ignore[import-not-found]

    class KvpoolHiCacheStorage(HiCachePoolLogic, HiCacheStorage):  # type: ignore[misc]
        """Constructed by SGLang with a HiCacheStorageConfig; extra_config names the pool."""

        def __init__(self, storage_config: Any, kv_cache: Any = None) -> None:
            from kvpool.client import PoolClient

            extra = storage_config.extra_config or {}
            revision = str(extra.get("model_revision", ""))
            if not revision:
                raise InvalidArgument(
                    "extra_config has no model_revision: SGLang page keys hash tokens only, so pages "
                    "of other weights under the same model name would be served",
                    hint="set extra_config['model_revision'] to a name of these exact weights (a hub commit "
                    "hash, or kvpool.connectors.fingerprint.module_fingerprint(model))",
                )
            if getattr(storage_config, "should_split_heads", False):
                raise UnsupportedModel(
                    "should_split_heads (pages split over another TP width) is not supported",
                    hint="use a TP size that divides the kv heads, or run without the kvpool storage backend",
                )
            layout = "page_first" if storage_config.is_page_first_layout else "layer_first"
            spec = sglang_page_spec(
                model=storage_config.model_name or "unknown",
                num_layers=int(extra["num_layers"]),
                local_kv_heads=int(extra["local_kv_heads"]),
                head_dim=int(extra["head_dim"]),
                dtype=str(extra.get("dtype", "bfloat16")),
                page_size=int(extra["page_size"]),
                layout=layout,
                tp_rank=storage_config.tp_rank,
                tp_size=storage_config.tp_size,
                is_mla=storage_config.is_mla_model,
                model_revision=revision,
                pp_rank=int(getattr(storage_config, "pp_rank", 0)),
                pp_size=int(getattr(storage_config, "pp_size", 1)),
                cp_rank=int(getattr(storage_config, "attn_cp_rank", 0)),
                cp_size=int(getattr(storage_config, "attn_cp_size", 1)),
            )
            salt = str(extra.get("salt", "")).encode()
            client = PoolClient.connect(str(extra["pool_address"]), spec, salt=salt)
            HiCachePoolLogic.__init__(self, client, spec, salt, layout=layout)
            if kv_cache is not None:
                self.register_mem_pool_host(kv_cache)

    return KvpoolHiCacheStorage


_BUILT: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name == "KvpoolHiCacheStorage":
        if name not in _BUILT:
            _BUILT[name] = _build_sglang_class()
        return _BUILT[name]
    raise AttributeError(name)
