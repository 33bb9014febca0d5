"""``kvpool inspect lookup --directory A``: one prompt explained across a cluster.

Each member the directory lists explains the prompt itself (the ``Inspect`` RPC on its own
store and removal log); the reports are merged block by block: a block hits if some node
holds it (every holder and the fastest tier are listed), and the chain stops at the first
block no node holds. That block's reason is the most telling one any node gives (a put in
flight, then evicted, a checksum failure, an I/O error or a removal beats "other namespace",
which beats "never stored"), and ``per_node`` keeps every node's own answer; a node whose
latest lease of the namespace was refused is listed in ``lease_refused`` with why. A member
that does not answer, or does not know the namespace, is listed in ``skipped`` with why.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvpool.cli.inspect import BadInput, open_admin
from kvpool.cli.inspect_ops import cluster_nodes, explain_on, resolve_namespace
from kvpool.core.errors import KVPoolError

TIER_ORDER = ("device", "host", "disk")
REASON_ORDER = (
    "put_in_flight",
    "evicted",
    "checksum_failure",
    "io_error",
    "removed",
    "other_namespace",
    "never_stored",
)


def cluster_explain(args: argparse.Namespace, hashes: list[bytes], tokens: list[int]) -> dict[str, Any]:
    reports: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    addresses: dict[str, str] = {}
    for node in cluster_nodes(args):
        name, address = str(node["node_id"]), str(node.get("control_address", ""))
        try:
            with open_admin(args, address) as admin:
                reports[name] = explain_on(admin, resolve_namespace(admin, args.namespace), hashes, tokens)
            addresses[name] = address
        except (KVPoolError, BadInput) as err:
            skipped[name] = str(err)
    if not reports:
        raise BadInput(f"no member could explain the prompt: {skipped or 'the directory lists no nodes'}")
    merged = merge_reports(reports, skipped)
    stop = merged["stopped_at"]
    if stop is not None:  # a node whose own chain stopped earlier explains the cluster's stop block too
        block = bytes.fromhex(merged["blocks"][stop]["hash"])
        for name, node_address in addresses.items():
            row = merged["blocks"][stop]["per_node"].get(name)
            if row is None or "reason" in row:
                continue
            with open_admin(args, node_address) as admin:
                again = explain_on(admin, bytes.fromhex(merged["namespace"]), [block], [])
            reports[name]["blocks"][stop] = {**again["blocks"][0], "index": stop}
        merged = merge_reports(reports, skipped)
    return merged


def merge_reports(reports: dict[str, dict[str, Any]], skipped: dict[str, str]) -> dict[str, Any]:
    """One report from every node's (pure; tested without a cluster)."""
    first = next(iter(reports.values()))
    blocks: list[dict[str, Any]] = []
    stop: int | None = None
    for i, base in enumerate(first["blocks"]):
        rows = {name: r["blocks"][i] for name, r in reports.items() if i < len(r["blocks"])}
        holders = sorted(name for name, row in rows.items() if row["status"] == "hit")
        row: dict[str, Any] = {"index": i, "hash": base["hash"]}
        if holders:
            tiers = {rows[name]["tier"] for name in holders}
            row.update(status="hit", nodes=holders, tier=min(tiers, key=TIER_ORDER.index))
        else:
            row["status"] = "miss"
            if stop is None:
                stop = i
                answers = {name: r for name, r in rows.items() if "reason" in r}
                if answers:
                    best = min(answers.items(), key=lambda kv: REASON_ORDER.index(kv[1]["reason"]))
                    row.update({k: v for k, v in best[1].items() if k not in ("index", "hash", "status")})
                    row["nodes"] = [best[0]]
                row["per_node"] = {
                    name: {k: v for k, v in r.items() if k not in ("index", "hash")} for name, r in rows.items()
                }
        blocks.append(row)
    hits = stop if stop is not None else len(blocks)
    return {
        "node_id": "cluster",
        "namespace": first["namespace"],
        "spec": first["spec"],
        "block_tokens": first["block_tokens"],
        "blocks_total": len(blocks),
        "hit_blocks": hits,
        "hit_tokens": hits * int(first["block_tokens"]),
        "stopped_at": stop,
        "stop_reason": blocks[stop].get("reason") if stop is not None else None,
        "nodes": sorted(reports),
        "skipped": skipped,
        "lease_refused": {name: r["lease_refused"] for name, r in reports.items() if r.get("lease_refused")},
        "blocks": blocks,
    }
