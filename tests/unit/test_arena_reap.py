"""Arena files of dead daemons are reaped at start-up; live ones are left alone."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from kvpool.storage.arena import SharedArena


def test_reap_removes_only_arenas_of_dead_pids(tmp_path: pathlib.Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"kvpool-{dead_pid}-deadbeef.arena"
    stale.write_bytes(b"x")
    live = tmp_path / f"kvpool-{os.getppid()}-cafebabe.arena"
    live.write_bytes(b"x")
    other = tmp_path / "not-ours.arena"
    other.write_bytes(b"x")
    mine = SharedArena.create(str(tmp_path), 4096)
    try:
        removed = SharedArena.reap_stale(str(tmp_path))
        assert removed == [str(stale)]
        assert not stale.exists()
        assert live.exists() and other.exists() and pathlib.Path(mine.path).exists()
    finally:
        mine.close()
    assert not pathlib.Path(mine.path).exists()
