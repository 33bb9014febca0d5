"""The arena on transparent huge pages of shared memory (``storage/thp.py``), the parts that
need no host setting: reading the host's setting, the typed refusals (the setting off, an
arena past the memory, a kernel that cannot take pages with the advice, segments that are not
whole pages), the machinery itself with the setting given (on a host where it is off the
kernel gives 4 KiB pages, but every step runs: rounding, sealing, taking the pages, counting
them, a segment renewed for a new owner, no descriptor left behind), the config's checks, the
order of ``try``, a client adopting the node's page size within limits, and the doctor's
verdicts. The daemons on real transparent huge pages are in
``tests/integration/test_arena_thp.py``."""

from __future__ import annotations

import errno
import logging
import mmap
import os
from pathlib import Path

import pytest

from kvpool.cli.inspect_doctor import _arena_pages
from kvpool.core.arena_map import ArenaMapping
from kvpool.core.config import DaemonConfig, StoreConfig
from kvpool.core.errors import InvalidArgument
from kvpool.daemon.node import create_arena
from kvpool.storage import thp
from kvpool.storage.arena import HugePageRoom, HugePagesUnavailable, SharedArena
from kvpool.storage.arena_segments import SegmentedArena
from kvpool.storage.thp import ShmemThp, huge_bytes

MiB = 1 << 20
OFF = ShmemThp("never", 2 * MiB)
GIVEN = ShmemThp("advise", 2 * MiB)  # as if the host gave them: the kernel decides what it gets
NO_RESERVED = HugePageRoom(2 * MiB, 0, 0)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_one_piece_arena_with_the_setting_given_is_whole_pages_sealed_and_counted() -> None:
    fds = open_fds()
    arena = SharedArena.create_memfd(65 * MiB, transparent=GIVEN)
    try:
        assert arena.transparent and arena.page_bytes == 2 * MiB and arena.capacity_bytes == 65 * MiB
        assert os.fstat(arena.fd).st_size == 66 * MiB  # rounded up to whole huge pages
        assert 0 <= arena.huge_bytes <= 65 * MiB
        with pytest.raises(OSError):
            os.ftruncate(arena.fd, MiB)  # sealed like the 4 KiB arena
        arena.view[-4096:] = 7  # every page was taken: the last one too
        client = ArenaMapping.from_fd(arena.read_only_fd(), 65 * MiB)
        assert int(client.view[-1]) == 7 and not client.writable
        client.close()
    finally:
        arena.close()
    assert open_fds() == fds


def test_segments_with_the_setting_given_and_one_renewed_for_a_new_owner() -> None:
    fds = open_fds()
    arena = SegmentedArena(64 * MiB, 16 * MiB, huge_pages=False, meminfo_path="/proc/meminfo", transparent=GIVEN)
    try:
        assert arena.transparent and arena.page_bytes == 2 * MiB and 0 <= arena.huge_bytes <= 64 * MiB
        arena.on_owned(0, 1, 1)
        arena.view[:4096] = 9
        arena.on_owned(0, 2, 2)  # another owner: fresh memory, taken the same way
        assert arena.renewed == 1 and not arena.view[:4096].any()
        assert 0 <= arena.huge_bytes <= 64 * MiB
    finally:
        arena.close()
    assert open_fds() == fds
    with pytest.raises(HugePagesUnavailable, match="not whole transparent huge pages"):
        SegmentedArena(
            64 * MiB, 16 * MiB, huge_pages=False, meminfo_path="/proc/meminfo", transparent=ShmemThp("advise", 32 * MiB)
        )


def test_an_arena_past_the_memory_is_refused_not_overcommitted(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable: 32768 kB\n")
    fds = open_fds()
    for make in (
        lambda: SharedArena.create_memfd(64 * MiB, allow_overcommit=True, meminfo_path=str(meminfo), transparent=GIVEN),
        lambda: SegmentedArena(64 * MiB, 16 * MiB, huge_pages=False, meminfo_path=str(meminfo), transparent=GIVEN),
    ):  # one-piece and per-tenant alike: the same refusal, which try falls back from
        with pytest.raises(HugePagesUnavailable, match=r"takes its .* at start") as info:
            make()
        assert "--arena-huge-pages off" in info.value.hint and "applies there" in info.value.hint
    assert open_fds() == fds


def test_a_segment_is_whole_transparent_pages_of_the_host_size_not_of_2_mib() -> None:
    """The last (short) segment rounds up to the host's huge page, as the one-piece arena
    does, where that page is larger than 2 MiB (an arm64 host's 512 MiB, say)."""
    arena = SegmentedArena(
        6 * MiB, 8 * MiB, huge_pages=False, meminfo_path="/proc/meminfo", transparent=ShmemThp("advise", 4 * MiB)
    )
    try:
        assert arena.page_bytes == 4 * MiB and arena._mapped_bytes(0) == 8 * MiB
    finally:
        arena.close()


def test_a_kernel_that_refuses_the_advice_is_refused_so_try_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """MADV_HUGEPAGE failing (a kernel without THP, libc not callable: ENOSYS) is
    ``HugePagesUnavailable``, which ``try`` falls back from, not a start refused for memory."""
    monkeypatch.setattr(thp, "madvise", lambda address, length, advice: errno.ENOSYS)
    fds = open_fds()
    with pytest.raises(HugePagesUnavailable, match="MADV_HUGEPAGE"):
        SharedArena.create_memfd(16 * MiB, transparent=GIVEN)
    assert open_fds() == fds
    config = DaemonConfig(store=StoreConfig(capacity_bytes=16 * MiB), arena_huge_pages="try")
    arena = create_arena(config, thp=GIVEN)
    try:
        assert not arena.transparent and arena.page_bytes == mmap.PAGESIZE  # 4 KiB pages, started
    finally:
        arena.close()


@pytest.mark.parametrize(
    ("share", "level", "note"),
    [
        (1.0, logging.INFO, ""),
        (0.9, logging.INFO, ""),
        (0.5, logging.WARNING, "fragmented"),
        (0.0, logging.WARNING, "gave none"),
    ],
)
def test_the_start_log_says_how_much_got_huge_pages_and_why_not(share: float, level: int, note: str) -> None:
    got_level, got_note = thp.huge_share_level(share)
    assert got_level == level and note in got_note and bool(got_note) == bool(note)


def test_a_kernel_that_cannot_take_pages_with_the_advice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before Linux 5.14 MADV_POPULATE_WRITE is EINVAL: refused (try then falls back to
    4 KiB pages), not an arena that says 2 MiB pages and has 4 KiB ones."""
    real = thp.madvise

    def old_kernel(address: int, length: int, advice: int) -> int:
        return errno.EINVAL if advice == thp.MADV_POPULATE_WRITE else real(address, length, advice)

    monkeypatch.setattr(thp, "madvise", old_kernel)
    fds = open_fds()
    with pytest.raises(HugePagesUnavailable, match=r"5\.14"):
        SharedArena.create_memfd(16 * MiB, transparent=GIVEN)
    assert open_fds() == fds


def sysfs(tmp_path: Path, shmem: str, per_size: str | None = None, pmd: str = "2097152") -> str:
    (tmp_path / "hpage_pmd_size").write_text(pmd + "\n")
    (tmp_path / "shmem_enabled").write_text(shmem + "\n")
    if per_size is not None:
        (tmp_path / "hugepages-2048kB").mkdir()
        (tmp_path / "hugepages-2048kB" / "shmem_enabled").write_text(per_size + "\n")
    return str(tmp_path)


@pytest.mark.parametrize(
    ("shmem", "per_size", "setting", "usable"),
    [
        ("always within_size [advise] never deny force", None, "advise", True),
        ("always within_size advise [never] deny force", None, "never", False),
        ("always [within_size] advise never deny force", "always inherit within_size advise [never]", "never", False),
        ("always within_size advise [never] deny force", "always [inherit] within_size advise never", "never", False),
        ("always within_size advise [never] deny force", "[always] inherit within_size advise never", "always", True),
        ("always within_size advise never [deny] force", None, "deny", False),
    ],
)
def test_the_host_setting_is_the_bracketed_word_per_size_first(
    tmp_path: Path, shmem: str, per_size: str | None, setting: str, usable: bool
) -> None:
    thp = ShmemThp.measure(sysfs(tmp_path, shmem, per_size))
    assert thp == ShmemThp(setting, 2 * MiB) and thp.usable is usable


def test_a_kernel_without_thp_is_unusable(tmp_path: Path) -> None:
    thp = ShmemThp.measure(str(tmp_path / "missing"))
    assert thp == ShmemThp("", 0) and not thp.usable and "no transparent huge pages" in thp.describe()


def test_off_is_a_typed_refusal_that_says_what_to_set() -> None:
    for make in (
        lambda: SharedArena.create_memfd(64 * MiB, transparent=OFF),
        lambda: SegmentedArena(64 * MiB, 16 * MiB, huge_pages=False, meminfo_path="/proc/meminfo", transparent=OFF),
    ):
        with pytest.raises(HugePagesUnavailable) as info:
            make()
        assert "shmem_enabled is never" in info.value.message
        assert "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled" in info.value.hint


def test_config_takes_thp_and_refuses_it_without_the_memfd_hand_off() -> None:
    config = DaemonConfig(arena_huge_pages="thp")
    assert config.arena_by_fd  # auto becomes fd, as for reserved huge pages
    with pytest.raises(InvalidArgument, match="thp needs the memfd hand-off"):
        DaemonConfig(arena_huge_pages="thp", arena_handoff="file")
    with pytest.raises(InvalidArgument, match="'off', 'on', 'thp' or 'try'"):
        DaemonConfig(arena_huge_pages="transparent")


def try_arena(thp: ShmemThp, caplog: pytest.LogCaptureFixture) -> SharedArena:
    """``create_arena`` with ``try`` and the host's setting as ``thp``, on a host with no
    reserved huge pages free (skipped elsewhere: try takes those)."""
    room = HugePageRoom.measure()
    if room.free_pages >= room.pages_for(64 * MiB):
        pytest.skip(f"this host has {room.free_pages} huge pages free: try takes those")
    with caplog.at_level(logging.INFO, logger="kvpool.node"):
        return create_arena(DaemonConfig(store=StoreConfig(capacity_bytes=64 * MiB), arena_huge_pages="try"), thp=thp)


def test_try_without_either_kind_falls_back_to_4k_pages_and_says_how(caplog: pytest.LogCaptureFixture) -> None:
    arena = try_arena(OFF, caplog)
    try:
        assert arena.page_bytes == mmap.PAGESIZE and not arena.transparent and arena.huge_bytes == 0
        said = caplog.text
        assert "4 KiB pages, not huge pages" in said and "nr_hugepages" in said and "shmem_enabled" in said
    finally:
        arena.close()
    with pytest.raises(HugePagesUnavailable, match="shmem_enabled is never"):
        create_arena(DaemonConfig(store=StoreConfig(capacity_bytes=64 * MiB), arena_huge_pages="thp"), thp=OFF)


def test_try_takes_transparent_pages_after_reserved_ones(caplog: pytest.LogCaptureFixture) -> None:
    arena = try_arena(GIVEN, caplog)
    try:
        assert arena.transparent and arena.page_bytes == 2 * MiB
        assert "transparent huge pages, not reserved ones" in caplog.text and "nr_hugepages" in caplog.text
    finally:
        arena.close()


def test_a_client_takes_the_page_size_the_node_names(tmp_path: Path) -> None:
    """A transparent huge page's file says 4 KiB: the client uses the node's 2 MiB for its
    windows; nonsense, more than 1 GiB, or 0 (an older node) changes nothing."""
    path = tmp_path / "arena"
    path.write_bytes(bytes(4 * MiB))
    arena = ArenaMapping.attach(str(path), 4 * MiB)
    try:
        for ignored in (0, 4096, 3 * MiB, 1000, 2 << 30):
            arena.adopt_page_bytes(ignored)
            assert arena.page_bytes == mmap.PAGESIZE
        arena.adopt_page_bytes(2 * MiB)
        assert arena.page_bytes == 2 * MiB and arena.huge_pages
        with arena.put_window([5 * 4096], 4096) as window:
            assert window.mapped_bytes == 2 * MiB  # whole huge pages
    finally:
        arena.close()


def test_a_per_tenant_client_takes_only_a_page_size_that_tiles_its_segments() -> None:
    from kvpool.core.arena_segments import SegmentedMapping

    def fetch(mode: str, put_id: int, segment: int) -> tuple[int, int]:
        raise AssertionError("nothing is mapped here")

    mapping = SegmentedMapping("test", 64 * MiB, 4 * MiB, fetch)
    try:
        mapping.adopt_page_bytes(8 * MiB)  # larger than a segment: a window would cross into the next
        assert mapping.page_bytes == mmap.PAGESIZE
        mapping.adopt_page_bytes(2 * MiB)
        assert mapping.page_bytes == 2 * MiB
    finally:
        mapping.close()


def test_huge_bytes_sums_only_the_mappings_inside_the_range(tmp_path: Path) -> None:
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f0000000000-7f0000400000 rw-s 00000000 00:01 7 /memfd:kvpool-arena (deleted)\n"
        "Size:               4096 kB\nShmemPmdMapped:     2048 kB\n"
        "7f0000400000-7f0000800000 rw-s 00000000 00:01 8 /memfd:kvpool-arena-1 (deleted)\n"
        "Size:               4096 kB\nShmemPmdMapped:     4096 kB\n"
        "7f0000800000-7f0000c00000 rw-s 00000000 00:01 9 /memfd:other (deleted)\n"
        "ShmemPmdMapped:     4096 kB\n"
    )
    base = 0x7F0000000000
    assert huge_bytes(base, 8 * MiB, str(smaps)) == 6 * MiB  # the third mapping is outside
    assert huge_bytes(base, 4 * MiB, str(smaps)) == 2 * MiB
    assert huge_bytes(base, 8 * MiB, str(tmp_path / "missing")) == 0


def doctor_stats(**extra: object) -> dict[str, object]:
    return {"arena_page_bytes": 2 * MiB, "arena_huge_pages": "thp", "capacity_bytes": 64 * MiB, **extra}


def test_doctor_says_transparent_and_how_much() -> None:
    config = DaemonConfig(store=StoreConfig(capacity_bytes=64 * MiB), arena_huge_pages="thp")
    on = ShmemThp("advise", 2 * MiB)
    full = _arena_pages(config, doctor_stats(arena_transparent=True, arena_huge_bytes=64 * MiB), NO_RESERVED, on)
    assert full.status == "ok" and "transparent huge pages of 2.0 MiB: 100%" in full.detail
    part = _arena_pages(config, doctor_stats(arena_transparent=True, arena_huge_bytes=16 * MiB), NO_RESERVED, on)
    assert part.status == "warn" and "25%" in part.detail and "fragmented" in part.detail
    # no daemon: what a start would get
    assert _arena_pages(config, None, NO_RESERVED, on).status == "ok"
    refused = _arena_pages(config, None, NO_RESERVED, OFF)
    assert refused.status == "fail" and "shmem_enabled" in refused.fix
    # a daemon on 4 KiB pages as asked: ok, and where the host gives transparent ones, says so
    off_config = DaemonConfig(store=StoreConfig(capacity_bytes=64 * MiB))
    running = {"arena_page_bytes": 4096, "arena_huge_pages": "off"}
    assert "--arena-huge-pages thp" in _arena_pages(off_config, running, NO_RESERVED, on).fix
    assert _arena_pages(off_config, running, NO_RESERVED, OFF).fix == ""
    assert _arena_pages(off_config, None, NO_RESERVED, on).status == "ok"
    try_config = DaemonConfig(store=StoreConfig(capacity_bytes=64 * MiB), arena_huge_pages="try")
    assert _arena_pages(try_config, None, NO_RESERVED, on).status == "ok"
    assert _arena_pages(try_config, None, NO_RESERVED, OFF).status == "warn"
