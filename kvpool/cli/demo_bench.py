"""``kvpool demo bench``: the serving modes side by side (placeholder until implemented)."""

from __future__ import annotations

import argparse


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run_bench(args: argparse.Namespace, cfg: object, workdir: str) -> int:
    raise NotImplementedError
