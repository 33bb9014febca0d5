"""Tables for ``kvpool inspect`` and ``kvpool top`` (rich). Pure functions from the daemon's
JSON answers to renderables, so the views are tested without a terminal and ``--json`` prints
the very same data."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

#: width of the output when it is not a terminal (a pipe, a file, a test): wide enough that
#: no cell wraps, so a line can be grepped
PIPE_WIDTH = 200

STAT_ROWS = [
    ("capacity_bytes", "capacity"),
    ("used_bytes", "used"),
    ("blocks", "blocks"),
    ("lookup_calls", "lookups (calls)"),
    ("lookup_hit_blocks", "lookup hits (blocks)"),
    ("lookup_missed_blocks", "lookup misses (blocks)"),
    ("lookup_hit_tokens", "lookup hits (tokens)"),
    ("lookup_missed_tokens", "lookup misses (tokens)"),
    ("read_calls", "reads (calls)"),
    ("read_hit_blocks", "reads served (blocks)"),
    ("read_missed_blocks", "reads not served (blocks)"),
    ("puts", "blocks stored"),
    ("skipped_present", "puts skipped (present)"),
    ("evictions", "evictions"),
    ("removed", "removed"),
    ("checksum_failures", "checksum failures"),
    ("leases_active", "read leases held"),
    ("expired_leases", "leases expired"),
    ("pending_puts", "puts in flight"),
    ("reclaimed_puts", "puts reclaimed (writer died)"),
    ("local_connections_open", "same-host socket connections"),
    ("local_connections_refused", "same-host socket refusals"),
    ("gc_full_collections", "full garbage collections"),
    ("gc_full_pause_seconds_max", "longest full GC pause (s)"),
    ("gc_whole_passes", "whole GC passes (frozen too)"),
]

TIER_COLUMNS = (
    ("capacity_bytes", "capacity"),
    ("used_bytes", "used"),
    ("blocks", "blocks"),
    ("hits", "read hits"),
    ("misses", "read misses"),
    ("evictions", "evictions"),
    ("checksum_failures", "checksum fails"),
    ("policy", "policy"),
)


def make_console(stream: Any = None) -> Console:
    out = stream or sys.stdout
    if out.isatty():
        return Console(file=out)
    return Console(file=out, width=PIPE_WIDTH, color_system=None, soft_wrap=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def hit_rate_text(stats: Mapping[str, Any]) -> str:
    """Lookup hit blocks / looked-up blocks (docs/architecture.md "Counters"); "n/a" before
    the first lookup, never a 100% made of nothing."""
    rate = stats.get("lookup_hit_rate")
    if rate is None:
        return "n/a (nothing looked up yet)"
    hit = stats.get("lookup_hit_blocks", 0)
    looked = hit + stats.get("lookup_missed_blocks", 0)
    return f"{100.0 * rate:.1f}% ({hit} of {looked} blocks)"


def age_text(age_ms: float) -> str:
    """How long ago, and the wall-clock time (this machine's clock)."""
    at = time.strftime("%H:%M:%S", time.localtime(time.time() - age_ms / 1000.0))
    seconds = age_ms / 1000.0
    if seconds < 120:
        return f"{seconds:.1f} s ago ({at})"
    return f"{seconds / 60:.1f} min ago ({at})"


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for name in columns:
        table.add_column(name, overflow="fold")
    return table


def stats_view(stats: Mapping[str, Any]) -> Group:
    table = _table(f"node {stats.get('node_id', '?')}  scheme {stats.get('hash_scheme', '?')}", "counter", "value")
    capacity = stats.get("capacity_bytes", 0) or 1
    for key, label in STAT_ROWS:
        if key not in stats:
            continue
        value = stats[key]
        if key.endswith("_bytes"):
            text = human_bytes(value)
            if key == "used_bytes":
                text += f" ({100.0 * value / capacity:.1f}%)"
        else:
            text = str(value)
        table.add_row(label, text)
    table.add_row("hit rate (lookups)", hit_rate_text(stats))
    by_tier = stats.get("lookup_hit_blocks_by_tier") or {}
    if by_tier:
        table.add_row("lookup hits by tier (blocks)", ", ".join(f"{tier}={n}" for tier, n in by_tier.items()))
    return Group(table, tiers_view(stats), tier_faults_view(stats))


#: a tier's fault and drop counters (docs/tiers.md "Statistics"), shown as key=value so that a
#: reader (or grep) finds each by its Stats name
TIER_FAULT_KEYS = (
    "demotion_drops",
    "admission_skips",
    "queue_full_drops",
    "unplaced_drops",
    "disk_full",
    "io_errors",
    "recovery_dropped",
)


def tier_faults_view(stats: Mapping[str, Any]) -> Table:
    """Per enabled tier: the counters of work a tier refused or lost (write-behind drops, a full
    disk, I/O errors) and its last faults: what explains blocks that never reached a tier."""
    table = _table("tier faults and drops", "tier", "counters", "last faults")
    for name, tier in tiers_of(stats).items():
        if not tier.get("enabled", True):
            continue
        counters = ", ".join(f"{key}={tier[key]}" for key in TIER_FAULT_KEYS if key in tier)
        faults = tier.get("faults") or []
        if counters or faults:
            table.add_row(name, counters or "-", "; ".join(str(f) for f in faults[-3:]) or "none")
    return table


def tiers_of(stats: Mapping[str, Any]) -> Mapping[str, Mapping[str, Any]]:
    """Each tier's stats; a host-only store has no ``tiers`` table: its top-level keys are the
    host tier's."""
    tiers = stats.get("tiers")
    return tiers if isinstance(tiers, Mapping) else {"host": {**stats, "enabled": True}}


def tiers_view(stats: Mapping[str, Any]) -> Table:
    table = _table("tiers", "tier", "enabled", *(label for _, label in TIER_COLUMNS))
    tiers = tiers_of(stats)
    for name in ("device", "host", "disk"):
        tier = tiers.get(name)
        if tier is None:
            continue
        if not tier.get("enabled", True):
            table.add_row(name, "no" + (f" ({tier['fault']})" if tier.get("fault") else ""))
            continue
        cells = []
        for key, _ in TIER_COLUMNS:
            value = tier.get(key, "")
            cells.append(human_bytes(value) if key.endswith("_bytes") and isinstance(value, int) else str(value))
        table.add_row(name, "yes", *cells)
    return table


def namespaces_view(namespaces: Sequence[Mapping[str, Any]]) -> Table:
    table = _table(f"{len(namespaces)} namespaces", "digest", "spec", "block", "used", "lookup hit rate")
    for ns in namespaces:
        table.add_row(
            ns["digest"],
            ns["spec"],
            human_bytes(ns["block_bytes"]),
            human_bytes(ns.get("used_bytes", 0)),
            hit_rate_text(ns),
        )
    return table


def short_hashes(hashes: Sequence[str], shown: int = 3) -> str:
    text = " ".join(h[:12] for h in hashes[:shown])
    return text + (f" +{len(hashes) - shown}" if len(hashes) > shown else "")


def events_view(events: Iterable[Mapping[str, Any]], title: str = "events") -> Table:
    table = _table(title, "seq", "kind", "tier", "blocks", "namespace", "hashes")
    for e in events:
        table.add_row(
            str(e["seq"]), e["kind"], e["tier"], str(e["blocks"]), e["namespace"][:16], short_hashes(e["hashes"])
        )
    return table


def event_line(e: Mapping[str, Any]) -> str:
    """One followed event (``--follow`` prints lines as they come: a table cannot grow)."""
    return (
        f"#{e['seq']:<6} {e['kind']:<8} {e['tier']:<6} {e['blocks']:>5} blocks  "
        f"ns={e['namespace'][:16]}  {short_hashes(e['hashes'])}"
    )


def blocks_view(last_seq: int, total: int, hashes: Sequence[str]) -> Table:
    table = _table(f"{total} blocks (as of event {last_seq}); first {len(hashes)}", "hash")
    for h in hashes:
        table.add_row(h)
    return table


def nodes_view(nodes: Sequence[Mapping[str, Any]]) -> Table:
    table = _table(
        f"{len(nodes)} nodes", "node", "address", "live", "used", "capacity", "blocks", "tiers", "hit rate", "leases"
    )
    for n in nodes:
        capacity = n.get("capacity_bytes", 0) or 0
        used = n.get("used_bytes", 0) or 0
        share = f" ({100.0 * used / capacity:.0f}%)" if capacity else ""
        table.add_row(
            n["node_id"],
            n.get("control_address", ""),
            n.get("live", "?"),
            human_bytes(used) + share,
            human_bytes(capacity),
            str(n.get("blocks", "")),
            ",".join(n.get("tiers", [])),
            n.get("hit_rate", ""),
            str(n.get("leases_active", "")),
        )
    return table


def hot_view(hot: Mapping[str, Any]) -> Group:
    blocks = _table("most-read blocks (decayed counts)", "reads", "tier", "namespace", "hash")
    for b in hot.get("blocks", []):
        blocks.add_row(str(b["reads"]), b["tier"] or "(gone)", b["namespace"][:16], b["hash"])
    prefixes = _table("most-read prefixes (first block of a read)", "reads", "longest read", "namespace", "first hash")
    for p in hot.get("prefixes", []):
        prefixes.add_row(str(p["reads"]), f"{p['longest_blocks']} blocks", p["namespace"][:16], p["first_hash"])
    return Group(blocks, prefixes)


def reason_text(row: Mapping[str, Any]) -> str:
    reason = row.get("reason", "")
    if reason == "evicted":
        return f"evicted from {row.get('tier', '?')} by {row.get('policy', '?')} {age_text(row.get('age_ms', 0.0))}"
    if reason == "put_in_flight":
        return (
            f"a put of it is in flight (started, not committed): visible at its commit, reclaimed in "
            f"{row.get('expires_in_ms', 0.0) / 1000:.1f} s if the writer never commits"
        )
    if reason == "io_error":
        return f"dropped from {row.get('tier', '?')} after an I/O error {age_text(row.get('age_ms', 0.0))}"
    if reason == "checksum_failure":
        return f"failed its checksum on {row.get('tier', '?')} and was dropped {age_text(row.get('age_ms', 0.0))}"
    if reason == "removed":
        return f"removed by a client or an operator {age_text(row.get('age_ms', 0.0))}"
    if reason == "other_namespace":
        names = ", ".join(ns[:16] for ns in row.get("namespaces", []))
        return f"stored only under another namespace ({names}): a different model, layout, salt or adapter"
    if reason == "never_stored":
        return "never stored here (or removed before the removal log's window)"
    return reason


def lookup_view(report: Mapping[str, Any]) -> Group:
    total, hits = report["blocks_total"], report["hit_blocks"]
    head = Text(
        f"namespace {report['namespace'][:16]} ({report['spec']}): {hits} of {total} blocks hit "
        f"({report['hit_tokens']} tokens)"
    )
    table = _table("", "block", "status", "node", "tier", "hash", "why")
    for row in report["blocks"]:
        why = reason_text(row) if row["status"] == "miss" else row.get("lease", "")
        if row["status"] == "hit" and row.get("hard_pin"):
            why = ("hard-pinned; " + why).strip("; ")
        table.add_row(
            str(row["index"]),
            row["status"],
            ",".join(row.get("nodes", [])) or report.get("node_id", ""),
            row.get("tier", ""),
            row["hash"][:16],
            why,
        )
    parts: list[Any] = [head, table]
    stop = report.get("stopped_at")
    if stop is not None:
        parts.append(Text(f"the chain stops at block {stop}: {reason_text(report['blocks'][stop])}"))
    else:
        parts.append(Text("every block hits: the whole prompt is cached"))
    refused = report.get("lease_refused") or {}
    per_node = refused.items() if "code" not in refused else [(report.get("node_id", ""), refused)]
    for node, why in per_node:
        parts.append(Text(f"reads on {node}: {lease_refusal_text(why)}"))
    return Group(*parts)


def lease_refusal_text(why: Mapping[str, Any]) -> str:
    """One line for a lease refusal of ``lookup``'s ``lease_refused``."""
    if why.get("age_ms") is None:
        return f"the next lease would be refused ({why['code']}): {why['message']}"
    return (
        f"the latest lease was refused {age_text(why['age_ms'])} ({why['code']}): {why['message']}; "
        "no lease was granted since"
    )
