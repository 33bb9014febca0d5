"""Write docs/api.md from the docstrings of kvpool's public client API (stdlib ``inspect``).

    python tools/gen_api_docs.py            # rewrite docs/api.md
    python tools/gen_api_docs.py --check    # exit 1 if docs/api.md is not what it would write

What is listed is ``API`` below; tests/unit/test_api_docs.py checks that every public class
and method in it has a docstring.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "api.md"

#: (section title, what it is for, [dotted names of classes])
API: list[tuple[str, str, list[str]]] = [
    (
        "Clients",
        "Same-host clients map the daemon's arena; the cluster client asks the directory where blocks live.",
        [
            "kvpool.client.pool_client.PoolClient",
            "kvpool.client.async_client.AsyncPoolClient",
            "kvpool.client.cluster_client.ClusterClient",
            "kvpool.client.pool_common.PutResult",
            "kvpool.client.pool_client.StagedPut",
        ],
    ),
    (
        "Operators",
        "Stats, events, snapshots, explain, hot blocks, removal and pins.",
        ["kvpool.client.admin.PoolAdmin"],
    ),
    (
        "Identity",
        "What names a block: the spec and the namespace.",
        ["kvpool.core.spec.KVSpec", "kvpool.core.spec.Namespace"],
    ),
    (
        "Connectors",
        "Engines' side: every connector takes a ``BlockPool`` (a ``PoolClient`` or a wrapper of one).",
        [
            "kvpool.connectors.pool_api.BlockPool",
            "kvpool.connectors.pool_api.SlotPool",
            "kvpool.connectors.hf.HFConnector",
            "kvpool.connectors.vllm.VllmPoolConnectorLogic",
            "kvpool.connectors.sglang.HiCachePoolLogic",
            "kvpool.connectors.resilient_pool.ResilientPool",
            "kvpool.connectors.compressed_pool.CompressedPool",
            "kvpool.connectors.pool_api.InProcessPool",
        ],
    ),
]

ERRORS_MODULE = "kvpool.core.errors"


def resolve(dotted: str) -> type:
    module, _, name = dotted.rpartition(".")
    obj = getattr(importlib.import_module(module), name)
    assert isinstance(obj, type), dotted
    return obj


def public_members(cls: type) -> list[tuple[str, object]]:
    """Methods and properties defined on ``cls`` itself: public ones, ``__init__`` first."""
    out = []
    generated_init = dataclasses.is_dataclass(cls) or getattr(cls, "_is_protocol", False)
    for name, member in cls.__dict__.items():
        if name.startswith("_") and (name != "__init__" or generated_init):
            continue
        if isinstance(member, staticmethod | classmethod):
            member = member.__func__
        if inspect.isfunction(member) or isinstance(member, property):
            out.append((name, member))
    return sorted(out, key=lambda kv: (kv[0] != "__init__", kv[0] != "connect", list(cls.__dict__).index(kv[0])))


def signature(name: str, member: object) -> str:
    if isinstance(member, property):
        return f"{name}  (property)"
    try:
        sig = inspect.signature(member)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return name
    parts = []
    for p in sig.parameters.values():
        if p.name in ("self", "cls"):
            continue
        text = ("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
        if p.annotation is not p.empty:
            text += f": {p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}"
        parts.append(text)
    ret = sig.return_annotation
    arrow = (
        ""
        if ret is sig.empty or ret == "None"
        else f" -> {ret if isinstance(ret, str) else inspect.formatannotation(ret)}"
    )
    return f"{name}({', '.join(parts)}){arrow}"


def doc_of(member: object) -> str:
    target = member.fget if isinstance(member, property) else member
    return inspect.cleandoc(getattr(target, "__doc__", None) or "")


def render() -> str:
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `python tools/gen_api_docs.py` (do not edit by hand).",
        "The names users import: `from kvpool import KVSpec, PoolClient, AsyncPoolClient, PoolAdmin, KVPoolError`;",
        "connectors from `kvpool.connectors.*`, the cluster client from `kvpool.client.cluster_client`.",
        "",
    ]
    for title, blurb, names in API:
        lines += [f"## {title}", "", blurb, ""]
        for dotted in names:
            cls = resolve(dotted)
            lines += [f"### `{cls.__name__}`", "", f"`{dotted}`", "", doc_of(cls) or "(no docstring)", ""]
            for name, member in public_members(cls):
                lines += [f"- **`{signature(name, member)}`**"]
                text = doc_of(member)
                if text:
                    lines += ["", *(f"  {line}" if line else "" for line in text.splitlines())]
                lines.append("")
    errors = importlib.import_module(ERRORS_MODULE)
    lines += [
        "## Errors",
        "",
        inspect.cleandoc(errors.__doc__ or ""),
        "",
        "| error | code | gRPC status | meaning |",
        "|---|---|---|---|",
    ]
    base = errors.KVPoolError
    for name, cls in vars(errors).items():
        if isinstance(cls, type) and issubclass(cls, base):
            meaning = " ".join(doc_of(cls).split())
            lines.append(f"| `{name}` | `{cls.code.wire_name}` | {cls.code.grpc_status} | {meaning} |")
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is out of date")
    args = parser.parse_args()
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print("docs/api.md is out of date: run python tools/gen_api_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
