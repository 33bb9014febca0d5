"""The arena is checked against what the machine has and reserved up front (storage/arena.py).

The daemon-level behaviour (a refusal at start, a tiny tmpfs, the override) is in
``tests/integration/test_arena_capacity_daemon.py``; this file checks the rule itself.
"""

from __future__ import annotations

import logging
import os
import pathlib

import pytest

from kvpool.core.errors import CapacityExhausted, InvalidArgument
from kvpool.daemon.config_loader import add_daemon_arguments, load_config, parse_switch
from kvpool.storage.arena import ArenaRoom, SharedArena, available_memory_bytes, filesystem_free_bytes

MiB = 1 << 20
TiB = 1 << 40


def fake_meminfo(tmp_path: pathlib.Path, available_kib: int | None) -> str:
    path = tmp_path / "meminfo"
    lines = ["MemTotal:       24684084 kB", "MemFree:         1000000 kB"]
    if available_kib is not None:
        lines.append(f"MemAvailable:   {available_kib} kB")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_mem_available_is_read_in_bytes(tmp_path: pathlib.Path) -> None:
    assert available_memory_bytes(fake_meminfo(tmp_path, 22891260)) == 22891260 * 1024
    assert available_memory_bytes(fake_meminfo(tmp_path, None)) is None  # old kernel: no field
    assert available_memory_bytes(str(tmp_path / "absent")) is None
    real = available_memory_bytes()
    assert real is None or real > 0


def test_shortfalls_name_each_limit_passed() -> None:
    room = ArenaRoom("/dev/shm", mem_available_bytes=8 * MiB, fs_free_bytes=4 * MiB)
    assert room.shortfalls(4 * MiB) == []
    assert room.shortfalls(5 * MiB) == ["the free space of /dev/shm (4194304 bytes (4.00 MiB))"]
    both = room.shortfalls(9 * MiB)
    assert len(both) == 2 and "MemAvailable 8388608 bytes (8.00 MiB)" in both[0]
    assert room.most_bytes() == 4 * MiB
    unknown = ArenaRoom("/x", mem_available_bytes=None, fs_free_bytes=TiB)
    assert unknown.shortfalls(TiB) == [] and unknown.most_bytes() == TiB


def test_an_arena_beyond_memory_is_refused_naming_the_numbers(tmp_path: pathlib.Path) -> None:
    meminfo = fake_meminfo(tmp_path, 1024)  # 1 MiB available
    with pytest.raises(CapacityExhausted) as info:
        SharedArena.create(str(tmp_path), 4 * MiB, meminfo_path=meminfo)
    text = str(info.value)
    assert "4194304 bytes (4.00 MiB)" in text and "MemAvailable 1048576 bytes" in text
    assert "--capacity-bytes" in info.value.hint and "--allow-overcommit" in info.value.hint
    assert "at most 1048576 bytes" in info.value.hint
    assert "\n" not in text
    assert list(tmp_path.glob("*.arena")) == []  # nothing was created


def test_an_arena_beyond_the_filesystem_is_refused(tmp_path: pathlib.Path) -> None:
    free = filesystem_free_bytes(str(tmp_path))
    with pytest.raises(CapacityExhausted, match="free space of"):
        SharedArena.create(str(tmp_path), free + TiB, meminfo_path=fake_meminfo(tmp_path, None))
    assert list(tmp_path.glob("*.arena")) == []


def test_a_fitting_arena_is_reserved_in_full(tmp_path: pathlib.Path) -> None:
    arena = SharedArena.create(str(tmp_path), 4 * MiB)
    try:
        assert os.stat(arena.path).st_blocks * 512 >= 4 * MiB  # allocated, not a sparse file
        arena.view[:] = 7
        assert int(arena.view[-1]) == 7
    finally:
        arena.close()


def test_overcommit_is_allowed_explicitly_with_a_warning(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    meminfo = fake_meminfo(tmp_path, 1024)
    with caplog.at_level(logging.WARNING, logger="kvpool.arena"):
        arena = SharedArena.create(str(tmp_path), 4 * MiB, allow_overcommit=True, meminfo_path=meminfo)
    try:
        assert os.stat(arena.path).st_blocks == 0  # left sparse: nothing reserved
        assert any("--allow-overcommit" in r.getMessage() and "SIGBUS" in r.getMessage() for r in caplog.records)
    finally:
        arena.close()


def test_allow_overcommit_from_flag_env_and_toml(tmp_path: pathlib.Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_daemon_arguments(parser)
    assert load_config(parser.parse_args([]), {}).store.allow_overcommit is False
    assert load_config(parser.parse_args(["--allow-overcommit"]), {}).store.allow_overcommit is True
    assert load_config(parser.parse_args([]), {"KVPOOL_ALLOW_OVERCOMMIT": "yes"}).store.allow_overcommit is True
    toml = tmp_path / "kvpool.toml"
    toml.write_text("[store]\nallow_overcommit = true\n")
    assert load_config(parser.parse_args(["--config", str(toml)]), {}).store.allow_overcommit is True
    with pytest.raises(InvalidArgument, match="yes/no"):
        load_config(parser.parse_args([]), {"KVPOOL_ALLOW_OVERCOMMIT": "maybe"})
    assert parse_switch("off") is False and parse_switch(False) is False
