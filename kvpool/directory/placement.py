"""Where a put goes: the client's own node first when it has room, then the nodes with the
largest free share, ``replicas`` distinct nodes in all. A pure function of the registry's
view (capacity and use as each node last reported them in a heartbeat)."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.core.errors import InvalidArgument, NotFound
from kvpool.core.invariants import DEBUG, require
from kvpool.directory.index import NodeRecord


def choose_nodes(
    live: Sequence[NodeRecord],
    local: NodeRecord | None,
    blocks: int,
    block_bytes: int,
    replicas: int = 1,
    min_free_ratio: float = 0.05,
) -> list[NodeRecord]:
    if replicas <= 0:
        raise InvalidArgument("replicas must be >= 1")
    if not live:
        raise NotFound(
            "no live node is registered with the directory",
            hint="start 'kvpool serve --directory ...' on at least one node",
        )
    need_bytes = blocks * block_bytes

    def fits(node: NodeRecord) -> bool:
        return node.free_ratio >= min_free_ratio and node.capacity_bytes - node.used_bytes >= need_bytes

    chosen: list[NodeRecord] = []
    if local is not None and local.alive and fits(local):
        chosen.append(local)
    rest = sorted((n for n in live if n not in chosen), key=lambda n: (-n.free_ratio, n.node_id))
    for node in rest:
        if len(chosen) >= replicas:
            break
        chosen.append(node)
    chosen = chosen[:replicas]
    if DEBUG.on:
        check_placement(chosen, live, local, replicas)
    return chosen


def check_placement(
    chosen: Sequence[NodeRecord], live: Sequence[NodeRecord], local: NodeRecord | None, replicas: int
) -> None:
    """A placement names at most ``replicas`` distinct live nodes (debug mode)."""
    name = "placement"
    require(name, "at most the replicas asked for", 0 < len(chosen) <= replicas, f"{len(chosen)} of {replicas}")
    ids = [n.node_id for n in chosen]
    require(name, "distinct nodes", len(set(ids)) == len(ids), str(ids))
    for node in chosen:
        require(name, "only live nodes", node.alive and (node in live or node is local), node.node_id)
