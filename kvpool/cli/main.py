"""``kvpool``: one entry point, one subcommand module each.

Each subcommand lives in its own module under ``kvpool.cli`` with two functions,
``add_arguments(parser)`` and ``run(args) -> int``; only the module of the subcommand being
run is imported (``main``), so that ``kvpool serve`` does not pay for the router's HTTP stack,
rich or the simulator (0.4 CPU-s of imports, at every daemon start).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kvpool.core import invariants

#: subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvpool.cli.serve", "run a pool daemon (node + directory on one machine by default)"),
    "inspect": (
        "kvpool.cli.inspect",
        "look inside a running pool: stats, tiers, nodes, events, lookup (why a miss), hot, pin/evict, doctor",
    ),
    "top": ("kvpool.cli.top", "full-screen live view of a pool (q quits)"),
    "sim": ("kvpool.cli.sim", "replay a request trace through the scheduler policies (discrete-event)"),
    "router": ("kvpool.cli.router", "run the cache-aware router daemon"),
    "directory": ("kvpool.cli.directory", "run the cluster directory (master) service"),
    "cluster": ("kvpool.cli.cluster", "start a local cluster (N nodes, etcd, directory) on 127.0.0.1: up/status/down"),
    "demo": ("kvpool.cli.demo", "a PD-disaggregated cluster on this machine behind an OpenAI front door; modes bench"),
    "auth": ("kvpool.cli.auth", "make tokens and their sha256 for a daemon's --credentials file"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``only`` (a subcommand name) just that subcommand's options are
    built (its module imported), the others listed by name and help line."""
    from kvpool.core.version import VERSION as __version__

    parser = argparse.ArgumentParser(
        prog="kvpool",
        description="kvpool: a global KV-cache pool for LLM serving. Run 'kvpool SUBCOMMAND --help' for details.",
    )
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.startswith("kvpool"):
                continue  # subcommand not built yet
            raise
        sub_parser = sub.add_parser(
            name, help=help_text, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def quiet_grpc_core(environ: dict[str, str] | os._Environ[str]) -> None:
    """gRPC's C core logs its own errors to stderr (``E1201 ... add_port.cc:83 ...``) before
    kvpool prints the typed error that says what to do; silence it unless the user asked for
    its logs (GRPC_VERBOSITY=debug|info|error). Must run before grpc is first imported."""
    environ.setdefault("GRPC_VERBOSITY", "NONE")


def main(argv: list[str] | None = None) -> int:
    quiet_grpc_core(os.environ)
    invariants.enable_from_environ(os.environ)  # debug mode: stores check their invariants
    words = sys.argv[1:] if argv is None else argv
    first = next((w for w in words if not w.startswith("-")), None)
    parser = build_parser(first if first in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:  # output piped into head & co.: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
