"""Every option of the engine worker and the router says what it does in ``--help``
([ops] item 6: a user reads options there, not in the source)."""

from __future__ import annotations

import argparse

import pytest

from kvpool.cli import router
from kvpool.engine import worker


def _router_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    router.add_arguments(parser)
    return parser


@pytest.mark.parametrize("make", [worker.build_parser, _router_parser], ids=["worker", "router"])
def test_every_option_has_help(make: object) -> None:
    parser = make()  # type: ignore[operator]
    silent = [a.option_strings[0] for a in parser._actions if a.option_strings and not (a.help or "").strip()]
    assert silent == []
