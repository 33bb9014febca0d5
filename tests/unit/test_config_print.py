"""Config written down: one name per option across flag, env and TOML; the example config
is exactly what ``--print-config`` prints for the defaults and loads back to them; sources
are reported; a misplaced key says where it belongs. Plus the README's small promises:
``kvpool --version``, ``kvpool sim`` without --trace, no gRPC C-core noise on a busy port."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from kvpool import __version__
from kvpool.core.config import DaemonConfig
from kvpool.core.errors import InvalidArgument
from kvpool.daemon.config_loader import OPTIONS, add_daemon_arguments, load_config_sources
from kvpool.daemon.config_print import render_config

EXAMPLE = REPO_ROOT / "docs" / "kvpool.example.toml"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_daemon_arguments(parser)
    return parser.parse_args(list(argv))


def run_kvpool(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL_", "GRPC_"))} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", *argv], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=300, env=clean,
    )  # fmt: skip


def test_one_name_per_option() -> None:
    for opt in OPTIONS:
        leaf = opt.flag.lstrip("-").replace("-", "_")
        assert opt.key.rpartition(".")[2] == leaf and opt.env == "KVPOOL_" + leaf.upper()
    assert len({opt.key for opt in OPTIONS}) == len(OPTIONS) and len({opt.env for opt in OPTIONS}) == len(OPTIONS)


def test_every_config_field_is_an_option() -> None:
    def paths(obj: object, prefix: str = "") -> set[str]:
        out: set[str] = set()
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            value = getattr(obj, f.name)
            out |= paths(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else {prefix + f.name}
        return out

    assert paths(DaemonConfig()) == {opt.path for opt in OPTIONS}


def test_the_example_config_is_the_printed_defaults_and_loads_back_to_them() -> None:
    config, sources = load_config_sources(parse(), {})
    assert sources == {}
    assert render_config(config, sources) == EXAMPLE.read_text(), "regenerate: kvpool serve --print-config"
    loaded, from_file = load_config_sources(parse("--config", str(EXAMPLE)), {})
    assert loaded == DaemonConfig()
    assert set(from_file.values()) == {f"file {EXAMPLE}"} and len(from_file) == len(OPTIONS)


def test_print_config_says_where_each_value_came_from(tmp_path: Path) -> None:
    toml = tmp_path / "kvpool.toml"
    toml.write_text('[store]\nlease_ttl_ms = 222\n[cluster]\nhost_name = "box-1"\n')
    done = run_kvpool(
        "serve", "--config", str(toml), "--print-config", "--listen", "127.0.0.1:7999",
        env={"KVPOOL_CAPACITY_BYTES": "1GiB"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()

    def source_of(key_line: str) -> str:
        i = lines.index(key_line)
        comment = " ".join(line for line in lines[max(0, i - 4) : i] if line.startswith("#"))
        return comment

    assert "(flag --listen)" in source_of('listen = "127.0.0.1:7999"')
    assert "(env KVPOOL_CAPACITY_BYTES)" in source_of("capacity_bytes = 1073741824")
    assert f"(file {toml})" in source_of("lease_ttl_ms = 222")
    assert f"(file {toml})" in source_of('host_name = "box-1"')
    assert "(default)" in source_of("put_ttl_ms = 30000")


def test_a_misplaced_or_misspelt_key_says_what_to_write(tmp_path: Path) -> None:
    toml = tmp_path / "kvpool.toml"
    toml.write_text("capacity_bytes = 1\n")
    with pytest.raises(InvalidArgument) as err:
        load_config_sources(parse("--config", str(toml)), {})
    assert "under [store]" in (err.value.hint or "") and "known" not in (err.value.hint or "")
    toml.write_text("[store]\ncapacty_bytes = 1\n")
    with pytest.raises(InvalidArgument) as err:
        load_config_sources(parse("--config", str(toml)), {})
    assert "did you mean store.capacity_bytes" in (err.value.hint or "")


def test_the_older_toml_spellings_are_still_read(tmp_path: Path) -> None:
    toml = tmp_path / "kvpool.toml"
    toml.write_text('credentials_file = ""\n[cluster]\nhost = "box-2"\ntoken_file = ""\n')
    config, _ = load_config_sources(parse("--config", str(toml)), {})
    assert config.cluster.host == "box-2"


def test_version() -> None:
    done = run_kvpool("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"kvpool {__version__}"


def test_sim_runs_without_a_trace_and_names_trace_when_one_is_missing() -> None:
    done = run_kvpool("sim", "--limit", "40", "--policy", "round-robin", "--no-progress", "--json")
    assert done.returncode == 0, done.stderr
    missing = run_kvpool("sim", "--trace", "/nonexistent/trace.jsonl")
    assert missing.returncode == 2 and "--trace" in missing.stderr and "Traceback" not in missing.stderr


def test_a_busy_port_prints_kvpool_s_line_without_grpc_core_noise(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for argv in (
            ["serve", "--capacity-bytes", "16MiB", "--arena-dir", str(tmp_path)],
            ["directory"],
        ):
            done = run_kvpool(*argv, "--listen", f"127.0.0.1:{port}")
            assert done.returncode == 1
            assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
            assert "add_port.cc" not in done.stderr and not any(
                line.startswith(("E1", "E0", "W1", "W0")) for line in done.stderr.splitlines()
            ), done.stderr
