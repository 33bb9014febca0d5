"""Run a kvpool daemon: one process that is node + directory, the embedded single-machine
default. Same-host clients (PoolClient) reach it over gRPC on 127.0.0.1 for control and
map its shared-memory arena for data. Stop it with SIGTERM or Ctrl-C (graceful).

Example:
  kvpool serve --listen 127.0.0.1:7450 --capacity-bytes 8GiB
  KVPOOL_CAPACITY_BYTES=8GiB kvpool serve --config kvpool.toml
  kvpool serve --config kvpool.toml --print-config   # effective values and where each came from
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvpool.core import invariants

SWITCH_INTERVAL_S = 0.0005


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpool.daemon.config_loader import add_daemon_arguments

    add_daemon_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvpool.core.errors import KVPoolError
    from kvpool.daemon.config_loader import environ, load_config_sources

    try:
        config, sources = load_config_sources(args, environ())
    except KVPoolError as err:
        print(f"kvpool serve: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        from kvpool.daemon.config_print import render_config

        print(render_config(config, sources), end="")
        return 0
    from kvpool.daemon.gc_pauses import GcFreezer
    from kvpool.daemon.server import PoolServer

    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # a thread running Python code keeps the interpreter lock up to this long before another
    # may take it: 5 ms by default, which a short lookup waits out behind another tenant's
    # large call; 0.5 ms keeps a small call's wait small (docs/security.md, fairness)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    invariants.log_if_enabled(logging.getLogger("kvpool.serve"))
    gc_freezer = GcFreezer(config.gc_full_interval_s) if config.gc_freeze else None
    try:
        server = PoolServer(config, gc_freezer)
        server.start()
    except KVPoolError as err:
        print(f"kvpool serve: {err}", file=sys.stderr)
        return 1
    print(
        f"kvpool: serving on {config.listen} (capacity {config.store.capacity_bytes} bytes); Ctrl-C or SIGTERM to stop",
        file=sys.stderr,
        flush=True,
    )
    return server.wait()
