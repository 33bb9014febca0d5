"""The arena on transparent huge pages of shared memory (``--arena-huge-pages thp``,
``storage/thp.py``), against real daemons.

- Where the host gives shared memory no transparent huge pages, ``thp`` refuses to start
  and says which setting to change; ``try`` starts on 4 KiB pages.
- Where the test can turn them on (root, ``shmem_enabled`` writable; it is set to
  ``advise`` and restored after), ``thp`` puts the arena on them with nothing reserved:
  Stats and doctor say so and how much of it got huge pages, a client adopts the node's
  2 MiB page size for its put windows (a transparent huge page's file reports 4 KiB), its
  read-only mapping maps the pages whole, and put / get_into return the bytes; the same
  per tenant, one memfd per segment; and ``try`` with no reserved huge pages free takes
  transparent ones.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import start_daemon
from test_arena_huge_pages import doctor, round_trip, two_tenants_round_trip

from kvpool.storage.arena import HugePageRoom
from kvpool.storage.thp import SYSFS_THP_DIR, ShmemThp, huge_bytes, shmem_setting

SHMEM_ENABLED = Path(SYSFS_THP_DIR) / "shmem_enabled"
MiB = 1 << 20


def test_thp_refuses_where_the_host_gives_none() -> None:
    if ShmemThp.measure().usable:
        pytest.skip(f"this host gives shared memory transparent huge pages ({ShmemThp.measure().describe()})")
    with pytest.raises(RuntimeError, match="shmem_enabled"):
        start_daemon("--arena-huge-pages", "thp", capacity="64MiB")


@pytest.fixture
def shmem_thp() -> Iterator[ShmemThp]:
    """Transparent huge pages for shared memory on ``advise`` (root only), restored after."""
    if not ShmemThp.measure().page_bytes:
        pytest.skip("this kernel has no transparent huge pages")
    if os.geteuid() != 0 or not os.access(SHMEM_ENABLED, os.W_OK):
        pytest.skip(f"turning them on needs root (echo advise > {SHMEM_ENABLED})")
    before = shmem_setting()
    if not before:
        pytest.skip(f"cannot read {SHMEM_ENABLED}")
    try:
        SHMEM_ENABLED.write_text("advise")
        thp = ShmemThp.measure()
        if not thp.usable:  # a per-size setting of never overrides the global one
            pytest.skip(f"transparent huge pages stay off for shared memory here ({thp.describe()})")
        yield thp
    finally:
        SHMEM_ENABLED.write_text(before)


def test_thp_puts_the_arena_on_transparent_huge_pages(shmem_thp: ShmemThp) -> None:
    reserved_before = HugePageRoom.measure().free_pages
    daemon = start_daemon("--arena-huge-pages", "thp", capacity="64MiB")
    try:
        assert HugePageRoom.measure().free_pages == reserved_before  # nothing reserved taken
        assert "on transparent huge pages (shmem_enabled advise)" in daemon.stderr()
        client = round_trip(daemon.address)
        arena = client._arena
        assert arena is not None and arena.page_bytes == 2 * MiB  # adopted from Hello
        assert os.fstat(arena.fd).st_blksize == 4096  # what the file itself says
        assert not client.arena.flags.writeable  # still read-only outside a put
        with arena.put_window([3 * 4096], 4096) as window:
            assert window.mapped_bytes == 2 * MiB  # the window is whole huge pages
        address = int(client.arena.ctypes.data)
        assert address % (2 * MiB) == 0
        int(client.arena[:: 2 * MiB].sum())  # touch each page: mapped as the kernel has it
        assert huge_bytes(address, 64 * MiB) >= 32 * MiB  # the client maps huge pages whole
        stats = client.stats()
        assert stats["arena_page_bytes"] == 2 * MiB and stats["arena_transparent"] is True
        assert stats["arena_huge_bytes"] >= 0.9 * 64 * MiB, stats["arena_huge_bytes"]
        client.close()
        pages = doctor(daemon.address)["arena pages"]
        assert pages["status"] == "ok" and "transparent huge pages of 2.0 MiB" in pages["detail"], pages
    finally:
        daemon.cleanup()


def test_a_per_tenant_arena_on_transparent_huge_pages(shmem_thp: ShmemThp, tmp_path: Path) -> None:
    from test_auth import write_credentials

    creds = write_credentials(str(tmp_path))
    daemon = start_daemon("--arena-huge-pages", "thp", "--credentials", creds, capacity="64MiB")
    try:
        _, stats = two_tenants_round_trip(daemon.address, seed=5)
        assert stats["arena_transparent"] is True and stats["arena_huge_bytes"] >= 0.9 * 64 * MiB
    finally:
        daemon.cleanup()


def test_try_takes_transparent_pages_when_none_are_reserved(shmem_thp: ShmemThp) -> None:
    room = HugePageRoom.measure()
    if room.free_pages >= room.pages_for(64 * MiB):
        pytest.skip(f"this host has {room.free_pages} reserved huge pages free: try takes those")
    daemon = start_daemon("--arena-huge-pages", "try", capacity="64MiB")
    try:
        client = round_trip(daemon.address)
        stats = client.stats()
        assert stats["arena_transparent"] is True and client._arena is not None
        assert client._arena.page_bytes == 2 * MiB
        client.close()
    finally:
        daemon.cleanup()
