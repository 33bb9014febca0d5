"""The distribution: storage/, scheduler/, kernels/ install as kvpool.storage / .scheduler /
.kernels, every package directory is listed, and a wheel carries them and the console script."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tomllib
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAPPED = {"kvpool": "kvpool", "kvpool.storage": "storage", "kvpool.scheduler": "scheduler", "kvpool.kernels": "kernels"}


def _declared_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(config["tool"]["setuptools"]["packages"])


def _package_dirs() -> set[str]:
    found: set[str] = set()
    for prefix, folder in MAPPED.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if "__pycache__" in rel.parts:
                continue
            name = ".".join([prefix, *rel.parts]) if rel.parts else prefix
            if prefix == "kvpool" and rel.parts and rel.parts[0] in {"storage", "scheduler", "kernels"}:
                continue
            found.add(name)
    return found


def test_every_package_directory_is_declared() -> None:
    missing = _package_dirs() - _declared_packages()
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_mapped_packages_import_from_their_folders() -> None:
    import kvpool.kernels
    import kvpool.scheduler
    import kvpool.storage

    for module, folder in ((kvpool.storage, "storage"), (kvpool.scheduler, "scheduler"), (kvpool.kernels, "kernels")):
        assert pathlib.Path(module.__file__ or "").resolve().parent == ROOT / folder


def test_wheel_contains_mapped_packages_and_console_script(tmp_path: pathlib.Path) -> None:
    pip_wheel = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run(
        [*pip_wheel, "-w", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("kvpool-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "kvpool/storage/host_store.py",
        "kvpool/storage/arena.py",
        "kvpool/scheduler/__init__.py",
        "kvpool/kernels/__init__.py",
        "kvpool/proto/pool_pb2.py",
        "kvpool/proto/pool.proto",
    ):
        assert required in names, required
    assert not any(n.startswith(("storage/", "scheduler/", "kernels/", "tests/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kvpool = kvpool.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_dev_setup_installs_the_nixl_pin_the_transport_names() -> None:
    """NIXL: the ``kvpool[nixl]`` extra (with torch pinned to the project's, so nixl-cu12's
    unpinned torch cannot resolve to a CUDA build) and tools/dev.sh's ``--no-deps`` install name
    the pin the transport names."""
    from kvpool.transport.nixl import NIXL_REQUIREMENT

    script = (ROOT / "tools" / "dev.sh").read_text()
    assert f'NIXL_REQUIREMENT="{NIXL_REQUIREMENT}"' in script
    assert '--no-deps "$NIXL_REQUIREMENT"' in script
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert NIXL_REQUIREMENT in extras["nixl"]
    torch_pins = {r for group in extras.values() for r in group if r.split(";")[0].strip().startswith("torch==")}
    assert len(torch_pins) == 1 and torch_pins <= set(extras["nixl"])


def test_version_matches_pyproject() -> None:
    import tomllib

    from kvpool.core.version import VERSION

    project = tomllib.loads((pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert project["version"] == VERSION


def test_the_http_stack_is_a_declared_dependency() -> None:
    """The router and the engine serve HTTP with Starlette on uvicorn (kvpool.rpc.http_json):
    a clean ``pip install kvpool`` must bring both, not only the vLLM extra that pulls them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = {dep.split(">")[0].split("=")[0].split("[")[0].strip() for dep in config["project"]["dependencies"]}
    assert {"starlette", "uvicorn"} <= names
