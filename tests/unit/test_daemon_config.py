"""Daemon configuration: flag > env > TOML > default, sizes, unknown keys, bad values."""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

import pytest

from kvpool.core.config import DaemonConfig, StoreConfig
from kvpool.core.errors import InvalidArgument
from kvpool.daemon.config_loader import OPTIONS, add_daemon_arguments, load_config, parse_bytes


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_daemon_arguments(parser)
    return parser.parse_args(list(argv))


def write_toml(tmp_path: pathlib.Path, text: str) -> str:
    path = tmp_path / "kvpool.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), (4096, 4096), ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1G", 10**9), ("512MB", 512 * 10**6),
     ("1.5KiB", 1536), ("3 kib", 3072), ("7b", 7), ("1Ti", 1 << 40), ("64mib", 64 << 20)],
)  # fmt: skip
def test_parse_bytes(text: str | int, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "12XB", "-5", "1.2.3GiB", "GiB", "5 GiBs"])
def test_parse_bytes_rejects_garbage(text: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_bytes(text)
    assert "GiB" in info.value.hint


def test_defaults_when_nothing_is_given() -> None:
    assert load_config(parse(), {}) == DaemonConfig()


def test_precedence_flag_over_env_over_toml_over_default(tmp_path: pathlib.Path) -> None:
    toml = write_toml(
        tmp_path,
        'listen = "127.0.0.1:9001"\nlog_level = "DEBUG"\n'
        '[store]\ncapacity_bytes = "1GiB"\nlease_ttl_ms = 111\nput_ttl_ms = 222\n',
    )
    env = {"KVPOOL_CAPACITY_BYTES": "256MiB", "KVPOOL_LEASE_TTL_MS": "333"}
    config = load_config(parse("--config", toml, "--lease-ttl-ms", "444"), env)
    assert config.store.lease_ttl_ms == 444  # flag beats env and TOML
    assert config.store.capacity_bytes == 256 << 20  # env beats TOML
    assert config.store.put_ttl_ms == 222  # TOML beats default
    assert config.listen == "127.0.0.1:9001" and config.log_level == "DEBUG"
    assert config.store.slab_bytes == StoreConfig().slab_bytes  # default


def test_config_file_from_env(tmp_path: pathlib.Path) -> None:
    toml = write_toml(tmp_path, '[tiers]\nhost_policy = "s3fifo"\n')
    assert load_config(parse(), {"KVPOOL_CONFIG": toml}).tiers.host_policy == "s3fifo"


def test_unknown_toml_key_is_an_error_naming_it(tmp_path: pathlib.Path) -> None:
    toml = write_toml(tmp_path, '[store]\ncapacity = "1GiB"\n')
    with pytest.raises(InvalidArgument, match=r"store\.capacity") as info:
        load_config(parse("--config", toml), {})
    assert "store.capacity_bytes" in info.value.hint


def test_unreadable_or_broken_toml(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read"):
        load_config(parse("--config", str(tmp_path / "missing.toml")), {})
    broken = write_toml(tmp_path, "listen = \n")
    with pytest.raises(InvalidArgument, match="cannot read"):
        load_config(parse("--config", broken), {})


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--lease-ttl-ms", "soon"], {}),
        ([], {"KVPOOL_HIGH_WATERMARK": "high"}),
        (["--capacity-bytes", "much"], {}),
        (["--lease-ttl-ms", "0"], {}),
        (["--high-watermark", "0.5", "--low-watermark", "0.9"], {}),
        (["--capacity-bytes", "1MiB", "--slab-bytes", "2MiB"], {}),
        (["--listen", "7450"], {}),
        (["--disk-admission", "sometimes"], {}),
        (["--grpc-workers", "0"], {}),
    ],
)
def test_bad_values_are_invalid_argument(argv: list[str], env: dict[str, str]) -> None:
    with pytest.raises(InvalidArgument):
        load_config(parse(*argv), env)


def test_every_option_has_a_kvpool_env_var_and_help() -> None:
    envs = [opt.env for opt in OPTIONS]
    assert len(set(envs)) == len(envs)
    for opt in OPTIONS:
        assert opt.env == "KVPOOL_" + opt.flag[2:].replace("-", "_").upper()
        assert len(opt.help) > 10 and opt.help.rstrip().endswith((".", ")"))


def test_every_option_reaches_its_config_field() -> None:
    """Each flag lands in the DaemonConfig field its path names (no silently dropped option)."""
    config = DaemonConfig()
    for opt in OPTIONS:
        obj: object = config
        for part in opt.path.split("."):
            assert hasattr(obj, part), opt.path
            obj = getattr(obj, part)


def test_serve_help_explains_each_option() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "serve", "--help"], capture_output=True, text=True, check=True
    )
    text = " ".join(done.stdout.split())
    for opt in OPTIONS:
        assert opt.flag in text and opt.env in text


def test_serve_with_a_bad_value_exits_2_with_a_message() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "serve", "--listen", "127.0.0.1:1", "--capacity-bytes", "much"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "much" in done.stderr and "INVALID_ARGUMENT" in done.stderr


def test_tier_watermarks_from_flags_env_and_toml(tmp_path: pathlib.Path) -> None:
    toml = write_toml(tmp_path, "[tiers]\ndisk_low_watermark = 0.5\ndevice_low_watermark = 0.4\n")
    env = {"KVPOOL_DISK_HIGH_WATERMARK": "0.8", "KVPOOL_DEVICE_HIGH_WATERMARK": "0.7"}
    config = load_config(parse("--config", toml, "--device-low-watermark", "0.6"), env)
    assert (config.tiers.disk_high_watermark, config.tiers.disk_low_watermark) == (0.8, 0.5)  # env, TOML
    assert (config.tiers.device_high_watermark, config.tiers.device_low_watermark) == (0.7, 0.6)  # env, flag
    flags = parse("--disk-high-watermark", "0.9", "--disk-low-watermark", "0.7")
    assert (load_config(flags, {}).tiers.disk_high_watermark, load_config(flags, {}).tiers.disk_low_watermark) == (
        0.9,
        0.7,
    )
    assert load_config(parse(), {}).tiers.disk_high_watermark == 0.95  # default
    with pytest.raises(InvalidArgument, match="disk watermarks"):
        load_config(parse("--disk-high-watermark", "0.5", "--disk-low-watermark", "0.9"), {})
    with pytest.raises(InvalidArgument, match="device watermarks"):
        load_config(parse(), {"KVPOOL_DEVICE_LOW_WATERMARK": "0"})
