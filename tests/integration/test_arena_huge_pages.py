"""The arena on huge pages (issue 13, item 3), against real daemons.

- Without enough free reserved huge pages, ``--arena-huge-pages try`` starts on 4 KiB pages
  and says so (log, Stats ``arena_page_bytes``, ``kvpool inspect doctor``), and ``on``
  refuses to start with the command that reserves them. Checked unit-level too, with a
  ``/proc/meminfo`` that reports none, so it runs on every host.
- Where the test can reserve huge pages (root, ``/proc/sys/vm/nr_hugepages`` writable, the
  kernel finds the memory), ``on`` puts the arena on them: the daemon's free huge pages drop
  by the arena's, Stats and doctor say 2 MiB pages, a client's mapping and put windows are
  made of huge pages, and put / get_into return the bytes. ``nr_hugepages`` is restored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO_ROOT, start_daemon

from kvpool import KVSpec, PoolClient
from kvpool.storage.arena import HugePageRoom, HugePagesUnavailable, SharedArena
from kvpool.storage.thp import ShmemThp

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
CAPACITY_BYTES = 64 << 20


def doctor(address: str) -> dict[str, dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "inspect", "doctor", "--json", "--address", address],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    return {c["name"]: c for c in json.loads(done.stdout)}


def round_trip(address: str) -> PoolClient:
    client = PoolClient.connect(address, SPEC, salt=b"huge")
    hashes = client.hashes(range(16 * 24))
    blocks = np.random.default_rng(3).standard_normal((24, *SPEC.block_shape)).astype(np.float16)
    assert client.put(hashes, blocks).stored == 24
    out = np.zeros_like(blocks)
    assert client.get_into(hashes, out) == 24 and np.array_equal(out, blocks)
    return client


def test_no_huge_pages_in_meminfo_is_a_typed_refusal(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable: 8000000 kB\nHugePages_Total: 4\nHugePages_Free: 2\nHugepagesize: 2048 kB\n")
    with pytest.raises(HugePagesUnavailable) as info:
        SharedArena.create_memfd(CAPACITY_BYTES, meminfo_path=str(meminfo), huge_pages=True)
    assert "32 free huge pages" in info.value.message and "2 free of 4" in info.value.message
    assert "echo 34 > /proc/sys/vm/nr_hugepages" in info.value.hint


def test_try_falls_back_to_4k_pages_and_on_refuses() -> None:
    room = HugePageRoom.measure()
    if room.free_pages >= room.pages_for(CAPACITY_BYTES):
        pytest.skip(f"this host has {room.free_pages} huge pages free: no fallback to see")
    if ShmemThp.measure().usable:
        pytest.skip("this host gives shared memory transparent huge pages: try takes those (test_arena_thp.py)")
    daemon = start_daemon("--arena-huge-pages", "try", capacity="64MiB")
    try:
        assert "4 KiB pages, not huge pages" in daemon.stderr() and "nr_hugepages" in daemon.stderr()
        client = round_trip(daemon.address)
        assert client._arena is not None and client._arena.page_bytes == 4096
        client.close()
        pages = doctor(daemon.address)["arena pages"]
        assert pages["status"] == "warn" and "4 KiB pages" in pages["detail"] and "fell back" in pages["detail"]
        assert "nr_hugepages" in pages["fix"]
    finally:
        daemon.cleanup()
    with pytest.raises(RuntimeError, match="nr_hugepages"):
        start_daemon("--arena-huge-pages", "on", capacity="64MiB")


@pytest.fixture
def reserved_huge_pages() -> Iterator[int]:
    """Reserve enough huge pages for one 64 MiB arena (root only), restore after."""
    try:
        before = int(NR_HUGEPAGES.read_text())
    except OSError as exc:
        pytest.skip(f"cannot read {NR_HUGEPAGES}: {exc}")
    if os.geteuid() != 0 or not os.access(NR_HUGEPAGES, os.W_OK):
        pytest.skip("reserving huge pages needs root (echo N > /proc/sys/vm/nr_hugepages)")
    room = HugePageRoom.measure()
    want = before + room.pages_for(CAPACITY_BYTES) + 2
    try:
        NR_HUGEPAGES.write_text(str(want))
        if HugePageRoom.measure().free_pages < room.pages_for(CAPACITY_BYTES):
            pytest.skip(f"the kernel reserved only {NR_HUGEPAGES.read_text().strip()} of {want} huge pages")
        yield want
    finally:
        NR_HUGEPAGES.write_text(str(before))


def test_on_puts_the_arena_on_huge_pages(reserved_huge_pages: int) -> None:
    free_before = HugePageRoom.measure().free_pages
    daemon = start_daemon("--arena-huge-pages", "on", capacity="64MiB")
    try:
        assert free_before - HugePageRoom.measure().free_pages == 32  # taken up front, every page
        client = round_trip(daemon.address)
        assert client._arena is not None and client._arena.page_bytes == 2 << 20
        assert not client.arena.flags.writeable  # still read-only outside a put
        with client._arena.put_window([3 * 4096], 4096) as window:
            assert window.mapped_bytes == 2 << 20  # the window is whole huge pages
        assert client.stats()["arena_page_bytes"] == 2 << 20
        client.close()
        pages = doctor(daemon.address)["arena pages"]
        assert pages["status"] == "ok" and "huge pages of 2.0 MiB" in pages["detail"], pages
    finally:
        daemon.cleanup()


def two_tenants_round_trip(address: str, seed: int) -> tuple[list[set[int]], dict[str, Any]]:
    """Two tenants each put and get 8 blocks through a per-tenant arena; (the segments each
    mapped, the last Stats). Each tenant's mapping is on whole 2 MiB pages from a 2 MiB boundary."""
    from test_auth import TOKEN_A, TOKEN_B

    from kvpool.core.arena_segments import SegmentedMapping

    blocks = np.random.default_rng(seed).standard_normal((8, *SPEC.block_shape)).astype(np.float16)
    segments, stats = [], {}
    for salt, token in ((b"salt-a", TOKEN_A), (b"salt-b", TOKEN_B)):
        with PoolClient.connect(address, SPEC, salt=salt, token=token) as client:
            hashes = client.hashes(range(16 * 8))
            assert client.put(hashes, blocks).stored == 8
            np.testing.assert_array_equal(client.get(hashes), blocks)
            assert isinstance(client._arena, SegmentedMapping) and client._arena.page_bytes == 2 << 20
            assert client.arena.ctypes.data % (2 << 20) == 0
            segments.append(set(client._arena.mapped_segments()))
            stats = client.stats()
    assert len(segments[0]) == len(segments[1]) == 1 and not segments[0] & segments[1]
    return segments, stats


def test_a_per_tenant_arena_on_huge_pages(reserved_huge_pages: int, tmp_path: Path) -> None:
    """With credentials the huge-page arena is per tenant: one hugetlb memfd per segment,
    each starting on a 2 MiB boundary; each tenant maps only its own, in whole huge pages."""
    from test_auth import write_credentials

    free_before = HugePageRoom.measure().free_pages
    creds = write_credentials(str(tmp_path))
    daemon = start_daemon("--arena-huge-pages", "on", "--credentials", creds, capacity="64MiB")
    try:
        assert free_before - HugePageRoom.measure().free_pages == 32  # every page of every segment, up front
        two_tenants_round_trip(daemon.address, seed=4)
    finally:
        daemon.cleanup()
