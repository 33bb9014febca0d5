"""Option help is generated from the config dataclasses: every default a user reads in
``kvpool serve --help`` is the one ``DaemonConfig`` has, and no help string repeats one by
hand (``kvpool/daemon/config_loader.py``)."""

from __future__ import annotations

import argparse

from hypothesis import given
from hypothesis import strategies as st

from kvpool.daemon.config_loader import (
    OPTIONS,
    add_daemon_arguments,
    config_default,
    default_help,
    format_bytes,
    parse_bytes,
    parse_octal,
)


def test_no_help_string_writes_a_default_by_hand() -> None:
    assert [o.flag for o in OPTIONS if "default" in o.help.lower()] == []


def test_the_help_shows_each_dataclass_default() -> None:
    parser = argparse.ArgumentParser()
    add_daemon_arguments(parser)
    helps = {a.option_strings[0]: a.help or "" for a in parser._actions if a.option_strings}
    for opt in OPTIONS:
        value = config_default(opt.path)
        text = helps[opt.flag]
        assert default_help(opt) in text and text.endswith(f"(env: {opt.env})")
        if opt.parse is parse_bytes:
            assert parse_bytes(format_bytes(value)) == value
            assert f"Default {format_bytes(value)}" in text
        elif opt.parse is parse_octal:
            assert int(f"{value:o}", 8) == value and f"Default {value:o}." in text
        elif not opt.default_means and isinstance(value, int | float) and not isinstance(value, bool):
            assert f"Default {value}." in text


def test_a_few_defaults_read_as_before() -> None:
    by_flag = {o.flag: default_help(o) for o in OPTIONS}
    assert by_flag["--capacity-bytes"] == "Default 2GiB."
    assert by_flag["--namespace-quota-bytes"] == "Default 0 (no quota)."
    assert by_flag["--etcd"] == "Default: none."
    assert by_flag["--allow-overcommit"] == "Default: refuse to start."


@given(st.integers(0, 1 << 50))
def test_sizes_shown_read_back_as_the_same_number(nbytes: int) -> None:
    assert parse_bytes(format_bytes(nbytes)) == nbytes
