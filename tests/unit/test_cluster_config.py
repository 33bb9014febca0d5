"""Cluster options: flags, environment and the [cluster] TOML table reach ClusterConfig;
the default stays the embedded single-machine pool (cluster mode off)."""

from __future__ import annotations

import argparse

import pytest

from kvpool.core.config import ClusterConfig, DaemonConfig
from kvpool.core.errors import InvalidArgument
from kvpool.daemon.config_loader import add_daemon_arguments, load_config


def parse(argv: list[str], env: dict[str, str] | None = None) -> DaemonConfig:
    parser = argparse.ArgumentParser()
    add_daemon_arguments(parser)
    return load_config(parser.parse_args(argv), env or {})


def test_default_is_embedded_single_machine() -> None:
    config = parse([])
    assert config.cluster == ClusterConfig()
    assert not config.cluster.enabled and not config.cluster.kv_events_endpoint


def test_flags_env_and_toml_fill_the_cluster_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    toml = tmp_path / "kvpool.toml"
    toml.write_text('[cluster]\ncluster = "prod"\nheartbeat_interval_ms = 250\n')
    config = parse(
        ["--config", str(toml), "--directory", "127.0.0.1:7440, 127.0.0.1:7441", "--transport", "ucx"],
        {"KVPOOL_ETCD": "127.0.0.1:2379", "KVPOOL_DATA_LISTEN": "127.0.0.1:7460"},
    )
    c = config.cluster
    assert c.enabled
    assert c.directory_list == ("127.0.0.1:7440", "127.0.0.1:7441")
    assert c.etcd_list == ("127.0.0.1:2379",)
    assert (c.cluster, c.heartbeat_interval_ms, c.transport, c.data_listen) == ("prod", 250, "ucx", "127.0.0.1:7460")


def test_bad_transport_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="transport"):
        ClusterConfig(transport="carrier-pigeon")


def test_directory_subcommand_is_registered() -> None:
    from kvpool.cli.main import build_parser

    args = build_parser().parse_args(["directory", "--listen", "127.0.0.1:7999", "--etcd", "a:1,b:2"])
    assert args.listen == "127.0.0.1:7999" and args.etcd == "a:1,b:2"
