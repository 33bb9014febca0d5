"""``kvpool cluster up --background`` gives up on a supervisor that never gets ready and
stops it even when it does not answer SIGTERM (a supervisor blocked where no Python signal
handler runs): nothing is left running."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.cli import cluster
from kvpool.core.errors import Unavailable


def test_a_supervisor_that_ignores_sigterm_is_killed_when_the_start_times_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def stuck_supervisor(argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        # stands in for the real supervisor: never writes its state file, ignores SIGTERM
        code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
        proc = real_popen([sys.executable, "-c", code], **kwargs)  # type: ignore[call-overload]
        started.append(proc)
        return proc  # type: ignore[no-any-return]

    monkeypatch.setattr(cluster.subprocess, "Popen", stuck_supervisor)
    monkeypatch.setattr(cluster, "BACKGROUND_START_TIMEOUT_S", 1.0)
    monkeypatch.setattr(cluster, "UNREADY_STOP_GRACE_S", 1.0)
    args = argparse.Namespace(
        nodes=1, capacity_bytes="64MiB", slab_bytes="16MiB", tls_cert_file="", tls_key_file="", tls_ca="", json=True
    )
    try:
        with pytest.raises(Unavailable, match="did not start within"):
            cluster._up_background(args, str(tmp_path))
        assert started and started[0].poll() is not None, "the stuck supervisor was left running"
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
