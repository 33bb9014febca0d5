"""The ``kvpool inspect`` views and admin actions (one ``do_VIEW(args) -> exit code`` each;
parsing and error handling live in ``kvpool.cli.inspect``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from kvpool.cli import inspect_render as render
from kvpool.cli.inspect import BadInput, address_of, open_admin, root_certs_of, token_of
from kvpool.client.admin import PoolAdmin
from kvpool.core.errors import KVPoolError, PermissionDenied, Unavailable, UnknownNamespace
from kvpool.core.events import KVEvent

#: most token ids read from a file or stdin (a 1M-token prompt)
MAX_TOKENS = 1 << 20
#: largest token file read, in bytes
MAX_TOKEN_FILE_BYTES = 16 << 20
#: blocks one Remove / Pin call names when clearing
CLEAR_BATCH_BLOCKS = 4096


def emit(args: argparse.Namespace, data: Any, view: Callable[[Any], Any]) -> int:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        render.make_console().print(view(data))
    return 0


def do_stats(args: argparse.Namespace) -> int:
    with open_admin(args, address_of(args)) as admin:
        return emit(args, admin.stats(), render.stats_view)


def do_tiers(args: argparse.Namespace) -> int:
    with open_admin(args, address_of(args)) as admin:
        stats = admin.stats()
    tiers = {
        name: {k: v for k, v in t.items() if not isinstance(v, dict | list)}
        for name, t in render.tiers_of(stats).items()
    }
    return emit(args, tiers, lambda _: render.tiers_view(stats))


def all_namespaces(admin: PoolAdmin) -> list[dict[str, Any]]:
    """Every page of the Stats namespace list (an admin view, docs/security.md)."""
    out: list[dict[str, Any]] = []
    after = b""
    while True:
        stats = admin.stats(namespaces_after=after)
        if "namespaces_next" not in stats:  # not an admin: only the caller's own entry
            raise PermissionDenied(
                "the namespace list is an admin view and this credential is not an admin's",
                hint="pass an admin token with --token (docs/security.md)",
            )
        out.extend(stats.get("namespaces", []))
        following = stats.get("namespaces_next", "")
        if not following:
            return out
        after = bytes.fromhex(following)


def do_namespaces(args: argparse.Namespace) -> int:
    with open_admin(args, address_of(args)) as admin:
        return emit(args, all_namespaces(admin), render.namespaces_view)


def require_limit(args: argparse.Namespace) -> None:
    if args.limit < 0:
        raise BadInput(f"--limit must be >= 0 (0 = the default), got {args.limit}")


def do_blocks(args: argparse.Namespace) -> int:
    require_limit(args)
    with open_admin(args, address_of(args)) as admin:
        last_seq, hashes = admin.snapshot()
    shown = [h.hex() for h in hashes[: max(0, args.limit)]]
    data = {"last_seq": last_seq, "total": len(hashes), "hashes": shown}
    return emit(args, data, lambda d: render.blocks_view(d["last_seq"], d["total"], d["hashes"]))


def event_record(event: KVEvent) -> dict[str, Any]:
    return {
        "node": event.node_id,
        "seq": event.seq,
        "kind": event.kind.value,
        "tier": event.tier,
        "blocks": len(event.hashes),
        "namespace": event.namespace.hex(),
        "hashes": [h.hex() for h in event.hashes],
    }


def do_events(args: argparse.Namespace) -> int:
    if args.count < 0 or args.from_seq < 0:
        raise BadInput("--count and --from-seq must be >= 0")
    with open_admin(args, address_of(args)) as admin:
        last = int(admin.stats().get("last_event_seq", 0))
        start = args.from_seq or max(1, last - args.count + 1)
        past: list[dict[str, Any]] = []
        stream: Iterator[KVEvent] = iter(())
        if last >= start:  # the kept events up to ``last``, then stop (or go on with --follow)
            stream = admin.events(start)
            for event in stream:
                past.append(event_record(event))
                if event.seq >= last:
                    break
        if args.json and not args.follow:
            print(json.dumps(past, indent=2))
        elif args.json:
            for record in past:
                print(json.dumps(record), flush=True)
        else:
            render.make_console().print(render.events_view(past, f"last {len(past)} events (node seq up to {last})"))
        if not args.follow:
            return 0
        following = admin.events(max(last + 1, start))
        for event in following:
            record = event_record(event)
            print(json.dumps(record) if args.json else render.event_line(record), flush=True)
    return 0


def do_hot(args: argparse.Namespace) -> int:
    require_limit(args)
    with open_admin(args, address_of(args)) as admin:
        return emit(args, admin.hot(args.limit), render.hot_view)


# -- nodes --------------------------------------------------------------------------------------
def node_row(stats: dict[str, Any], address: str) -> dict[str, Any]:
    tiers = render.tiers_of(stats)
    return {
        "node_id": stats.get("node_id", address),
        "control_address": address,
        "live": "yes",
        "capacity_bytes": stats.get("capacity_bytes", 0),
        "used_bytes": stats.get("used_bytes", 0),
        "blocks": stats.get("blocks", 0),
        "tiers": [name for name, t in tiers.items() if t.get("enabled", True)],
        "hit_rate": render.hit_rate_text(stats),
        "lookup_hit_rate": stats.get("lookup_hit_rate"),
        "leases_active": stats.get("leases_active", 0),
    }


def directory_call(args: argparse.Namespace, method: str, request: Any) -> Any:
    import grpc

    from kvpool.proto import directory_pb2_grpc
    from kvpool.rpc.auth import call_metadata, make_channel
    from kvpool.rpc.errors import from_rpc_error, looks_like_tls_failure

    channel = make_channel(args.directory, (), root_certs_of(args, "directory_tls_ca"))
    try:
        stub = directory_pb2_grpc.DirectoryStub(channel)
        return getattr(stub, method)(request, timeout=5.0, metadata=call_metadata(token_of(args)))
    except grpc.RpcError as exc:
        err = from_rpc_error(exc, args.directory)
        tls = looks_like_tls_failure(str(exc.details()))
        if isinstance(err, Unavailable) and exc.code() == grpc.StatusCode.UNAVAILABLE and not tls:
            err = Unavailable(  # a directory, not a daemon: say which one to start
                f"the kvpool directory at {args.directory} is not reachable ({exc.details()})",
                hint=f"start it with 'kvpool directory --listen {args.directory}' (or 'kvpool cluster up'), "
                "or check --directory",
            )
        raise err from None
    finally:
        channel.close()


def cluster_nodes(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The directory's members, each asked for its own stats (an unreachable one says so)."""
    from kvpool.proto import directory_pb2

    summary = json.loads(directory_call(args, "Stats", directory_pb2.StatsRequest()).json)
    alive = {n.node_id: n.alive for n in directory_call(args, "Nodes", directory_pb2.NodesRequest()).nodes}
    rows = []
    for node in summary.get("nodes", []):
        address = node.get("control_address", "")
        try:
            with open_admin(args, address) as admin:
                row = node_row(admin.stats(), address)
        except KVPoolError as err:
            row = {**node, "tiers": [], "hit_rate": f"unreachable: {err.message}"}
        row["node_id"] = node.get("node_id", row.get("node_id"))
        row["blocks_in_directory"] = node.get("blocks", 0)
        row["live"] = ("yes" if alive.get(node["node_id"], False) else "no") + (
            "" if node.get("confirmed", True) else " (unconfirmed)"
        )
        rows.append(row)
    return rows


def do_nodes(args: argparse.Namespace) -> int:
    if args.directory:
        rows = cluster_nodes(args)
    else:
        address = address_of(args)
        with open_admin(args, address) as admin:
            rows = [node_row(admin.stats(), address)]
    return emit(args, rows, render.nodes_view)


# -- blocks of a prompt ------------------------------------------------------------------------
def read_token_ids(path: str) -> list[int]:
    """Token ids from ``path`` ('-' = stdin): a JSON list of integers, or integers separated
    by white space or commas. BadInput naming the file and the format otherwise."""
    try:
        if path == "-":
            text = sys.stdin.read(MAX_TOKEN_FILE_BYTES + 1)
        else:
            with open(path, encoding="utf-8") as fh:
                text = fh.read(MAX_TOKEN_FILE_BYTES + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read token ids from {path}: {exc}") from None
    if len(text) > MAX_TOKEN_FILE_BYTES:
        raise BadInput(f"{path} is over {MAX_TOKEN_FILE_BYTES} bytes")
    form = "write a JSON list of integers, or integers separated by spaces or commas"
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    except ValueError as exc:
        raise BadInput(f"{path} does not hold token ids ({exc}); {form}") from None
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise BadInput(f"{path} does not hold a list of integers; {form}")
    if not values:
        raise BadInput(f"{path} holds no token ids")
    if len(values) > MAX_TOKENS or any(v < 0 or v >= 1 << 32 for v in values):
        raise BadInput(f"{path}: token ids must be 0 <= id < 2**32, at most {MAX_TOKENS} of them")
    return values


def tokenize(text: str, tokenizer: str | None) -> list[int]:
    if not tokenizer:
        raise BadInput("--text needs --tokenizer NAME (a tokenizer transformers can load locally)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise BadInput("--text needs the transformers package (pip install 'kvpool[engines]')") from None
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise BadInput(f"cannot load tokenizer {tokenizer!r} locally: {str(exc).splitlines()[0]}") from None
    return [int(t) for t in tok(text)["input_ids"]]


def prompt_of(args: argparse.Namespace) -> tuple[list[bytes], list[int]]:
    """(hashes, token ids) named by --hashes / --tokens / --text: exactly one of them."""
    given = [name for name in ("hashes", "tokens", "text") if getattr(args, name)]
    if len(given) != 1:
        raise BadInput("name the blocks with exactly one of --tokens FILE, --text TEXT or --hashes HEX,...")
    if args.hashes:
        try:
            hashes = [bytes.fromhex(h.strip()) for h in args.hashes.split(",") if h.strip()]
        except ValueError:
            raise BadInput("--hashes: comma-separated hex block hashes (32 hex digits each)") from None
        if not hashes or any(len(h) != 16 for h in hashes):
            raise BadInput("--hashes: each block hash is 16 bytes (32 hex digits)")
        return hashes, []
    if args.tokens:
        return [], read_token_ids(args.tokens)
    return [], tokenize(args.text, args.tokenizer)


def resolve_namespace(admin: PoolAdmin, text: str | None) -> bytes:
    """The digest ``text`` names (hex or a unique prefix), else the only one on the node."""
    namespaces = [ns["digest"] for ns in all_namespaces(admin)]
    if text:
        word = text.strip().lower()
        matches = [d for d in namespaces if d.startswith(word)]
        if len(matches) == 1:
            return bytes.fromhex(matches[0])
        if not matches:
            raise UnknownNamespace(
                f"no namespace {word!r} on {admin.address}",
                hint="'kvpool inspect namespaces' lists them; a client registers its namespace when it connects",
            )
        raise BadInput(f"namespace prefix {word!r} matches {len(matches)} namespaces; give more digits")
    if len(namespaces) == 1:
        return bytes.fromhex(namespaces[0])
    raise BadInput(
        f"{admin.address} serves {len(namespaces)} namespaces; name one with --namespace "
        "(kvpool inspect namespaces lists them)"
    )


def explain_on(admin: PoolAdmin, namespace: bytes, hashes: list[bytes], tokens: list[int]) -> dict[str, Any]:
    return admin.explain(namespace, hashes=hashes, token_ids=tokens)


def do_lookup(args: argparse.Namespace) -> int:
    hashes, tokens = prompt_of(args)
    if args.directory:
        from kvpool.cli.inspect_cluster import cluster_explain

        report = cluster_explain(args, hashes, tokens)
    else:
        with open_admin(args, address_of(args)) as admin:
            report = explain_on(admin, resolve_namespace(admin, args.namespace), hashes, tokens)
    return emit(args, report, render.lookup_view)


def _target(admin: PoolAdmin, args: argparse.Namespace) -> tuple[bytes, list[bytes]]:
    """The namespace and the block hashes an admin action names."""
    namespace = resolve_namespace(admin, args.namespace)
    hashes, tokens = prompt_of(args)
    if tokens:  # the daemon hashes them with the namespace's spec
        hashes = [bytes.fromhex(b["hash"]) for b in explain_on(admin, namespace, [], tokens)["blocks"]]
    if not hashes:
        raise BadInput("those tokens make no full block (a block is the namespace's block_tokens tokens)")
    return namespace, hashes


def _changed(args: argparse.Namespace, action: str, namespace: bytes, asked: int, changed: int) -> int:
    data = {"action": action, "namespace": namespace.hex(), "blocks": asked, "changed": changed}
    if args.json:
        print(json.dumps(data))
    else:
        print(f"{action}: {changed} of {asked} blocks of namespace {namespace.hex()[:16]}")
    return 0


def do_pin(args: argparse.Namespace) -> int:
    if args.ttl_ms is not None and args.ttl_ms <= 0:
        raise BadInput("--ttl-ms must be positive (leave it out for a hard pin)")
    with open_admin(args, address_of(args)) as admin:
        namespace, hashes = _target(admin, args)
        changed = admin.pin(namespace, hashes, ttl_ms=args.ttl_ms)
    return _changed(
        args, "pinned" if args.ttl_ms is None else f"soft-pinned for {args.ttl_ms} ms", namespace, len(hashes), changed
    )


def do_unpin(args: argparse.Namespace) -> int:
    with open_admin(args, address_of(args)) as admin:
        namespace, hashes = _target(admin, args)
        changed = admin.pin(namespace, hashes, unpin=True)
    return _changed(args, "unpinned", namespace, len(hashes), changed)


def do_evict(args: argparse.Namespace) -> int:
    with open_admin(args, address_of(args)) as admin:
        namespace, hashes = _target(admin, args)
        removed = admin.remove(namespace, hashes)
    return _changed(args, "evicted", namespace, len(hashes), removed)


def do_clear(args: argparse.Namespace) -> int:
    address = address_of(args)
    with open_admin(args, address) as admin:
        digests = [resolve_namespace(admin, args.namespace)] if args.namespace else [
            bytes.fromhex(ns["digest"]) for ns in all_namespaces(admin)
        ]  # fmt: skip
        held = {ns: admin.snapshot(ns)[1] for ns in digests}
        total = sum(len(h) for h in held.values())
        if not args.yes:
            question = f"remove {total} blocks of {len(held)} namespaces from {address}?"
            if not sys.stdin.isatty():
                raise BadInput(f"{question} pass --yes to confirm (stdin is not a terminal to ask on)")
            if input(f"{question} [y/N] ").strip().lower() not in ("y", "yes"):
                print("nothing removed")
                return 1
        removed = 0
        for ns, hashes in held.items():
            for i in range(0, len(hashes), CLEAR_BATCH_BLOCKS):
                removed += admin.remove(ns, hashes[i : i + CLEAR_BATCH_BLOCKS])
    data = {"action": "cleared", "namespaces": len(held), "blocks": total, "removed": removed}
    print(json.dumps(data) if args.json else f"cleared: removed {removed} of {total} blocks in {len(held)} namespaces")
    return 0


def do_hitrate(args: argparse.Namespace) -> int:
    from kvpool.cli.inspect_hitrate import do_hitrate as hitrate

    return hitrate(args)


def do_doctor(args: argparse.Namespace) -> int:
    from kvpool.cli.inspect_doctor import doctor

    return doctor(args)
