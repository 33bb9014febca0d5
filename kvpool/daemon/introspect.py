"""The daemon side of ``kvpool inspect lookup`` and ``kvpool inspect hot`` (the ``Inspect``
RPC, an admin view): answers built from the store and the node's bounded block history
(``kvpool.daemon.block_history``), never from a second copy of the data.

``explain``: for each block of the chain, ``hit`` (with the fastest tier holding it, its pins
and leases) or ``miss``; the chain a prefix cache can use stops at the first miss, and that
block gets a reason, first match wins:
  - ``put_in_flight``     a put of it has started (PutStart) and not committed yet: it
                          becomes visible at commit, or is reclaimed at ``expires_in_ms``;
  - ``evicted``           the node evicted it (tier, policy, how long ago);
  - ``checksum_failure``  it failed its checksum and was dropped (the tier that found it:
                          host, disk or device; how long ago);
  - ``io_error``          the disk failed to read or write it and dropped it;
  - ``removed``           a client or an operator removed it (how long ago);
  - ``other_namespace``   the same hash is stored under another namespace (different model,
                          layout, tenant salt or adapter: blocks never match across them);
  - ``never_stored``      none of the above: never stored here, or removed longer ago than the
                          removal log remembers (its size is in the reply).
Blocks that hit can still reach no reader: ``lease_refused`` names why this namespace's
latest lease was refused or cut short, as it happened (``LeaseRefusals``: TENANT_BUSY,
PERMISSION_DENIED, UNKNOWN_NAMESPACE, INVALID_ARGUMENT past max_batch_blocks,
CAPACITY_EXHAUSTED at max_leases, NOT_PROMOTED for a disk / HBM block host could not take),
until a lease is granted again; and when the node holds ``max_leases`` leases right now, the
next lease would be refused, which it says too. An explain is not a lookup: it does not
enter the hit-rate counters.
"""

from __future__ import annotations

from typing import Any

from kvpool.core.errors import InvalidArgument
from kvpool.core.hashing import chain_hashes, unpack_hashes
from kvpool.core.keys import block_keys, key_hash, key_namespace
from kvpool.daemon.node import NamespaceInfo, PoolNode

#: most entries one "hot" answer lists
MAX_HOT_LIMIT = 1_000


def explain(node: PoolNode, info: NamespaceInfo, hashes: list[bytes]) -> dict[str, Any]:
    if len(hashes) > node.config.store.max_batch_blocks:
        raise InvalidArgument(
            f"{len(hashes)} blocks to explain; the limit is {node.config.store.max_batch_blocks}",
            hint="explain a shorter prompt",
        )
    keys = block_keys(info.digest, hashes)
    now_ms = node._clock.now_ms()
    summary = node.store.summary()
    lease_refused = _lease_refused(node, info.digest, summary.get("leases_active", 0), now_ms)
    blocks: list[dict[str, Any]] = []
    stop: int | None = None
    for i, key in enumerate(keys):
        row: dict[str, Any] = {"index": i, "hash": hashes[i].hex()}
        tier = node.store.tier_of(key)
        if tier:
            row.update(status="hit", tier=tier)
            entry = node.store.entry(key)
            if entry is not None and tier == "host":
                row.update(leases=entry.leases, hard_pin=entry.hard_pin, soft_pin=entry.soft_pin_until_ms > now_ms)
            if lease_refused is not None and stop is None:
                row["lease"] = f"refused: {lease_refused['code']}"
        else:
            row["status"] = "miss"
            removal = node.removals.get(key)
            deadline_ms = node.store.put_in_flight(key)
            if deadline_ms is not None:
                row.update(reason="put_in_flight", expires_in_ms=round(max(0.0, deadline_ms - now_ms), 1))
            elif removal is not None:
                row.update(reason=removal.reason, tier=removal.tier, age_ms=round(now_ms - removal.at_ms, 1))
                if removal.policy:
                    row["policy"] = removal.policy
            if stop is None:
                stop = i
        blocks.append(row)
    if stop is not None and "reason" not in blocks[stop]:
        others = _other_namespaces(node, info.digest, hashes[stop])
        if others:
            blocks[stop].update(reason="other_namespace", namespaces=[ns.hex() for ns in others])
        else:
            blocks[stop]["reason"] = "never_stored"
    hits = stop if stop is not None else len(keys)
    return {
        "node_id": node.node_id,
        "namespace": info.digest.hex(),
        "spec": info.spec.describe(),
        "block_tokens": info.spec.block_tokens,
        "blocks_total": len(keys),
        "hit_blocks": hits,
        "hit_tokens": hits * info.spec.block_tokens,
        "stopped_at": stop,
        "stop_reason": blocks[stop].get("reason") if stop is not None else None,
        "lease_refused": lease_refused,
        "removal_log_blocks": len(node.removals),
        "removal_log_capacity": node.removals.capacity,
        "blocks": blocks,
    }


def _lease_refused(node: PoolNode, namespace: bytes, leases_active: int, now_ms: float) -> dict[str, Any] | None:
    """Why a reader of ``namespace`` gets (or would get) no lease: the latest refusal the
    node recorded, else max_leases reached right now, else None."""
    refusal = node.lease_refusals.get(namespace)
    if refusal is not None:
        return {"code": refusal.code, "message": refusal.message, "age_ms": round(now_ms - refusal.at_ms, 1)}
    limit = node.config.store.max_leases
    if leases_active >= limit:
        return {
            "code": "CAPACITY_EXHAUSTED",
            "message": f"the node holds {leases_active} read leases (max_leases {limit}): the next lease is refused "
            "until some are released or expire (--max-leases)",
            "age_ms": None,
        }
    return None


def _other_namespaces(node: PoolNode, own: bytes, block_hash: bytes) -> list[bytes]:
    """Namespaces other than ``own`` holding ``block_hash`` (one scan of the node's keys:
    an admin call, bounded by the store's size)."""
    return sorted(
        {key_namespace(k) for k in node.store.snapshot_keys() if key_hash(k) == block_hash and key_namespace(k) != own}
    )


def hot(node: PoolNode, limit: int) -> dict[str, Any]:
    limit = min(limit or 20, MAX_HOT_LIMIT)
    return {
        "node_id": node.node_id,
        "tracked_capacity": node.hot.capacity,
        "blocks": [
            {"namespace": key_namespace(k).hex(), "hash": key_hash(k).hex(), "reads": n, "tier": node.store.tier_of(k)}
            for k, n in node.hot.top_blocks(limit)
        ],
        "prefixes": [
            {"namespace": key_namespace(k).hex(), "first_hash": key_hash(k).hex(), "reads": n, "longest_blocks": m}
            for k, n, m in node.hot.top_prefixes(limit)
        ],
    }


def inspect(node: PoolNode, request: Any) -> dict[str, Any]:
    """Answer one InspectRequest (the caller is an admin: checked by the service)."""
    if request.what == "hot":
        return hot(node, int(request.limit))
    if request.what != "explain":
        raise InvalidArgument(f"Inspect what={request.what!r} is not 'explain' or 'hot'")
    info = node.namespace(bytes(request.namespace))
    if request.hashes and request.token_ids:
        raise InvalidArgument("give hashes or token ids, not both")
    if request.token_ids:
        limit = node.config.store.max_batch_blocks * info.spec.block_tokens
        if len(request.token_ids) > limit:
            raise InvalidArgument(f"{len(request.token_ids)} tokens; the limit is {limit}")
        hashes = chain_hashes(info.digest, list(request.token_ids), info.spec.block_tokens)
    else:
        hashes = unpack_hashes(bytes(request.hashes))
    return explain(node, info, hashes)
