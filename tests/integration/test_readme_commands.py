"""The README works as written: every command in its code blocks (and every ``kvpool ...`` /
``bash tools/...`` command with options in its prose) is either run here, from a fresh
directory outside the repository against a daemon this test starts, or listed in ``NOT_RUN``
with the reason it cannot run in CI time and the test that covers it instead. A command
added to the README without a place in one of the two tables fails
``test_every_readme_command_is_run_or_says_why_not``, so the README cannot silently rot.

What changes from the README's text, and why: ``.venv/bin/`` is this interpreter's bin
directory (the same venv in CI); the daemon of ``bash tools/dev.sh serve`` is started on a
free loopback port (other tests run in parallel; the README's 127.0.0.1:7450 becomes
that address, through ``KVPOOL_ADDRESS`` for the CLI and in the Python quick start's text).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO_ROOT, DaemonHandle, free_port, start_daemon

README = Path(REPO_ROOT) / "README.md"
BIN = str(Path(sys.executable).parent)
README_ADDRESS = "127.0.0.1:7450"

#: README commands run by ``test_the_readme_commands_run_from_a_fresh_directory``, with what
#: their output must show (a substring of stdout)
RUN: dict[str, str] = {
    ".venv/bin/kvpool --version": "kvpool ",
    ".venv/bin/kvpool inspect stats": "capacity",
    ".venv/bin/kvpool inspect stats --json": '"blocks": 6',
    ".venv/bin/kvpool inspect events --count 5": "stored",
    ".venv/bin/kvpool inspect namespaces": "tiny-llama",
    ".venv/bin/kvpool inspect hot": "most-read",
    "echo 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 | .venv/bin/kvpool inspect lookup --tokens -": "1 of 1 blocks hit",
    ".venv/bin/kvpool inspect doctor": "daemon",
    ".venv/bin/kvpool sim --limit 2000 --policy kv-centric,least-loaded,dynamo": "least-loaded",
    ".venv/bin/kvpool router --help": "usage:",
    ".venv/bin/kvpool directory --help": "usage:",
    ".venv/bin/python -m kvpool.engine.worker --help": "usage:",
    "kvpool serve --print-config": "capacity_bytes",
    "bash tools/dev.sh serve --help": "--capacity-bytes",
}

#: README commands not run here: why, and what covers them instead
NOT_RUN: dict[str, str] = {
    "bash tools/dev.sh serve": "serves until stopped (and sets up .venv first); the test starts the same "
    "'kvpool serve' on a free port and runs the Quick start against it",
    "bash tools/dev.sh test": "is the test suite itself (CI runs it)",
    ".venv/bin/kvpool top": "needs a terminal and runs until q: tests/integration/test_top_pty.py drives it in a "
    "pseudo-terminal (one daemon and a 3-node cluster)",
    ".venv/bin/kvpool demo --engine ref": "starts pool, engines and router and binds :8000 until stopped: "
    "tests/integration/test_demo.py",
    "curl -N http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' "
    '-d \'{"prompt": "w1 w2 w3", "max_tokens": 8, "stream": true}\'': "needs the demo running: "
    "tests/integration/test_demo.py streams a completion",
    ".venv/bin/kvpool demo": "real vLLM engines take minutes to start on a CPU: tests/vllm/",
    ".venv/bin/kvpool demo bench": "a benchmark of minutes (docs/demo.md has its figures)",
    ".venv/bin/kvpool cluster up --nodes 3": "needs etcd and runs until stopped: tests/integration/test_cluster_up.py",
    ".venv/bin/python tools/bench_vllm.py": "a benchmark of real vLLM engines (minutes): docs/vllm.md",
    ".venv/bin/python tools/bench_pool.py": "a benchmark (minutes on a loaded machine): docs/benchmarks.md",
    "kvpool serve --metrics-listen 127.0.0.1:9450": "a fixed port; the test's daemon runs with --metrics-listen on "
    "a free port and /metrics is scraped (test_the_readme_commands_run_from_a_fresh_directory)",
}


def readme_commands() -> list[str]:
    """Every command of the README's bash blocks (comments and line continuations folded) and
    every inline ``kvpool ...`` / ``bash tools/...`` span with an option."""
    text = README.read_text()
    commands: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        folded = re.sub(r"\\\n\s*", "", block)
        for line in folded.splitlines():
            command = re.split(r"\s+# ", line)[0].strip()
            if command and not command.startswith("#"):
                commands.append(re.sub(r"\s+", " ", command))
    for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        span = re.sub(r"\s+", " ", span.strip())
        if span.startswith(("kvpool ", "bash tools/")) and " --" in span:
            commands.append(span)
    return commands


def quick_start_python() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1, "the README has one Python quick start"
    return blocks[0]


def test_every_readme_command_is_run_or_says_why_not() -> None:
    commands = readme_commands()
    assert len(commands) >= 20, commands  # the parser still finds the README's commands
    unlisted = [c for c in commands if c not in RUN and c not in NOT_RUN]
    assert not unlisted, f"README commands neither run by this test nor listed with a reason: {unlisted}"
    stale = [c for c in (*RUN, *NOT_RUN) if c not in commands]
    assert not stale, f"listed here but no longer in the README: {stale}"
    assert README_ADDRESS in quick_start_python()


@pytest.fixture
def readme_daemon() -> tuple[DaemonHandle, str]:
    metrics = f"127.0.0.1:{free_port()}"
    daemon = start_daemon("--metrics-listen", metrics)
    yield daemon, metrics  # type: ignore[misc]
    daemon.cleanup()


def run_in(cwd: Path, command: str, address: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")} | {"KVPOOL_ADDRESS": address}
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")  # 'kvpool' in prose is the venv's
    command = command.replace(".venv/bin/", BIN + "/").replace("bash tools/", f"bash {REPO_ROOT}/tools/")
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.timeout(900)
def test_the_readme_commands_run_from_a_fresh_directory(
    readme_daemon: tuple[DaemonHandle, str], tmp_path: Path
) -> None:
    daemon, metrics = readme_daemon
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    quick = quick_start_python().replace(README_ADDRESS, daemon.address)
    done = subprocess.run([sys.executable, "-c", quick], cwd=fresh, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    failures = []
    for command, expected in RUN.items():
        done = run_in(fresh, command, daemon.address)
        if done.returncode != 0 or expected not in done.stdout or "Traceback" in done.stderr:
            failures.append(f"{command!r}: exit {done.returncode}, stdout {done.stdout[-500:]!r}, "
                            f"stderr {done.stderr[-500:]!r}")  # fmt: skip
    assert not failures, "\n".join(failures)
    stats = json.loads(run_in(fresh, ".venv/bin/kvpool inspect stats --json", daemon.address).stdout)
    assert stats["blocks"] == 6 and stats["puts"] == 6  # the quick start's comments: 6 blocks
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
        assert b"kvpool_" in reply.read()
    assert list(fresh.iterdir()) == []  # nothing the README runs writes into the user's directory
