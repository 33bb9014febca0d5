"""``kvpool inspect doctor``'s nixl line: which NIXL backends start here, and a clear skip / fail
(with the install command) where NIXL is missing; and its copy-kernel line."""

from __future__ import annotations

import dataclasses

import pytest

from kvpool.cli.inspect_doctor import _nixl
from kvpool.core.config import ClusterConfig, DaemonConfig
from kvpool.transport import nixl_agent

NIXL_CONFIG = dataclasses.replace(DaemonConfig(), cluster=ClusterConfig(transport="nixl"))


def test_without_nixl_the_line_skips_or_fails_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_agent, "nixl_available", lambda: "ModuleNotFoundError: No module named 'nixl_cu12'")
    skipped, failed = _nixl(DaemonConfig()), _nixl(NIXL_CONFIG)
    assert (skipped.status, failed.status) == ("skip", "fail")
    assert "nixl-cu12" in failed.fix and "--no-deps" in failed.fix


def test_a_nixl_without_ucx_cannot_serve_the_data_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_agent, "nixl_available", lambda: "")
    monkeypatch.setattr(nixl_agent, "usable_backends", lambda: {"UCX": "plugin not shipped", "POSIX": ""})
    check = _nixl(NIXL_CONFIG)
    assert check.status == "fail" and "usable backends: POSIX" in check.detail and "UCX (plugin" in check.detail


@pytest.mark.nixl
@pytest.mark.skipif(bool(nixl_agent.nixl_available()), reason="nixl not installed")
def test_with_nixl_the_line_lists_the_backends_that_start_here() -> None:
    check = _nixl(NIXL_CONFIG)
    assert check.status == "ok" and "UCX" in check.detail.split(";")[0]
    assert ("staged" in check.detail) == nixl_agent.has_rdma()


def test_the_copy_kernel_line_says_which_path_copies_and_how_to_get_the_fast_one() -> None:
    """``copy kernel``: ok with the native kernel (AVX2 or portable C), a warning naming the
    fix without it (kvpool installed where no C compiler was)."""
    from kvpool.cli.inspect_doctor import _copy_kernel

    assert _copy_kernel("avx2").status == _copy_kernel("scalar").status == "ok"
    missing = _copy_kernel(None)
    assert missing.status == "warn" and "gcc" in missing.fix and "dev.sh setup" in missing.fix
