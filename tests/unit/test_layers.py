"""The layers hold: every import of one kvpool package by another goes downward in the table
of ``docs/architecture.md`` ("Dependency direction"), and the lowest layers load without
gRPC or the client. Reads the sources (every ``import``, also those inside functions), so
a lazy import upward fails too.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
# source folder -> the package name it installs as (pyproject's package-dir)
SOURCE_ROOTS = {
    "kvpool": "kvpool",
    "storage": "kvpool.storage",
    "scheduler": "kvpool.scheduler",
    "kernels": "kvpool.kernels",
}

# top first; a package imports only packages on rows below its own (not beside it)
LAYERS: list[list[str]] = [
    ["kvpool"],
    ["kvpool.cli"],
    ["kvpool.daemon", "kvpool.engine"],
    ["kvpool.connectors"],
    ["kvpool.scheduler"],
    ["kvpool.client", "kvpool.storage"],
    ["kvpool.directory"],
    ["kvpool.rpc", "kvpool.transport"],
    ["kvpool.kernels", "kvpool.proto"],
    ["kvpool.core"],
]
# (importing module, imported module) pairs not yet in line, each with the reason it stays
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
    # none: the client maps the node's arena through kvpool.core.arena_map (storage's
    # SharedArena is a subclass of it), no longer through storage.arena
}


def _rank() -> dict[str, int]:
    return {pkg: row for row, pkgs in enumerate(LAYERS) for pkg in pkgs}


def _package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "kvpool":
        return None
    return "kvpool" if len(parts) == 1 else ".".join(parts[:2])


def _modules() -> dict[str, pathlib.Path]:
    found: dict[str, pathlib.Path] = {}
    for folder, prefix in SOURCE_ROOTS.items():
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO / folder).with_suffix("")
            if folder == "kvpool" and rel.parts and rel.parts[0] in {"storage", "scheduler", "kernels"}:
                continue
            name = ".".join([prefix, *rel.parts]).removesuffix(".__init__")
            found[name] = path
    return found


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def upward_imports() -> list[str]:
    rank = _rank()
    bad: list[str] = []
    for module, path in sorted(_modules().items()):
        own = _package(module)
        assert own in rank, f"{module}: its package {own} is in no layer of LAYERS"
        for target in sorted(_imports(path)):
            other = _package(target)
            if other is None or other == own or (module, target) in KNOWN_EXCEPTIONS:
                continue
            assert other in rank, f"{module} imports {target}: package {other} is in no layer"
            if rank[other] <= rank[own]:
                where = "beside" if rank[other] == rank[own] else "above"
                bad.append(f"{module} imports {target} ({other} is {where} {own})")
    return bad


def test_no_module_imports_upward_or_sideways() -> None:
    assert upward_imports() == []


def test_the_known_exceptions_are_still_needed() -> None:
    modules = _modules()
    for (module, target), why in KNOWN_EXCEPTIONS.items():
        assert target in _imports(modules[module]), f"{module} no longer imports {target} ({why}): drop the exception"


def test_the_check_catches_an_upward_import(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "kvpool" / "core"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "bad.py").write_text("def f():\n    from kvpool.client import PoolClient\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "SOURCE_ROOTS", {"kvpool": "kvpool"})
    assert upward_imports() == ["kvpool.core.bad imports kvpool.client (kvpool.client is above kvpool.core)"]


def test_the_architecture_page_shows_these_layers() -> None:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"Dependency direction.*?```\n(.*?)```", text, re.S)
    assert block is not None, "docs/architecture.md has no dependency-direction block"
    rows = [[name.strip() for name in line.split("#")[0].split("|")] for line in block.group(1).splitlines()]
    assert [row for row in rows if row != [""]] == LAYERS


@pytest.mark.parametrize("module", ["kvpool.core", "kvpool.core.spec", "kvpool.core.hashing", "kvpool"])
def test_the_core_loads_without_grpc_or_the_client(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "loaded = [m for m in ('grpc', 'kvpool.client', 'kvpool.rpc', 'kvpool.proto') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_the_public_names_still_import() -> None:
    code = "from kvpool import AsyncPoolClient, KVPoolError, KVSpec, Namespace, PoolAdmin, PoolClient, PutResult"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
