"""``kvpool router`` flags and start-up of the OpenAI-compatible front door
(``kvpool.scheduler.router_openai``): kept here so the router's own module only calls two hooks."""

from __future__ import annotations

import argparse

from kvpool.scheduler.router_core import RouterCore
from kvpool.scheduler.router_openai import ROUTE_MODES, FrontDoor, FrontDoorServer, Instance, SplitPolicy


def add_openai_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("OpenAI front door (kvpool demo)")
    group.add_argument(
        "--openai-listen", default="", help="serve /v1/completions, /v1/chat/completions, /v1/models here; '' = off"
    )
    group.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="an engine instance, e.g. decode-0=http://127.0.0.1:8101 (repeat; names as --prefill/--decode make)",
    )
    group.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=256,
        help="prefill on the decode instance when at most this many prompt tokens are uncached (default 256)",
    )
    group.add_argument(
        "--busy-local-prefill-tokens",
        type=int,
        default=None,
        help="while the decode instance is decoding, prefill there only this many uncached tokens "
        "(a local prefill stalls every running decode for its duration); default: --local-prefill-tokens",
    )
    group.add_argument("--route", choices=ROUTE_MODES, default="auto", help="auto | local (always on decode) | remote")
    group.add_argument("--model-name", default="kvpool-demo", help="the model id /v1/models reports")
    group.add_argument("--vocab-size", type=int, default=1024, help="the engines' vocabulary (word tokenizer)")


def openai_policy(args: argparse.Namespace) -> SplitPolicy | None:
    """The policy of a router with a front door (it decides local vs remote prefill), else None."""
    if not args.openai_listen:
        return None
    return SplitPolicy(args.local_prefill_tokens, args.route, args.busy_local_prefill_tokens)


def start_openai(args: argparse.Namespace, core: RouterCore) -> FrontDoorServer | None:
    """Start the front door over ``core`` (built with ``openai_policy``) when --openai-listen is set."""
    from kvpool.core.errors import InvalidArgument
    from kvpool.core.words import WordTokenizer

    policy = core.policy
    if not args.openai_listen or not isinstance(policy, SplitPolicy):
        return None
    instances = []
    for item in args.engine:
        name, sep, url = item.partition("=")
        if not sep or not url.startswith("http://"):
            raise InvalidArgument(f"--engine {item!r} is not NAME=http://HOST:PORT")
        instances.append(Instance(name, url.rstrip("/")))
    door = FrontDoor(core, policy, instances, WordTokenizer.for_vocab(args.vocab_size), args.model_name)
    server = FrontDoorServer(door, args.openai_listen)
    server.start()
    return server
