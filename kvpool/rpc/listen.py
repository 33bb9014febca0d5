"""``HOST:PORT`` listen addresses, parsed one way for every HTTP listener kvpool opens
(metrics, the router, the OpenAI front door, the reference engine)."""

from __future__ import annotations

from kvpool.core.errors import InvalidArgument

LOOPBACK = "127.0.0.1"


def split_listen(listen: str, what: str = "listen address") -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); ``[::1]:PORT`` for IPv6; an empty host is loopback,
    never every interface. Anything else is ``InvalidArgument`` naming ``what``."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(f"{what} {listen!r} is not HOST:PORT", hint="e.g. 127.0.0.1:9450")
    return host.strip("[]") or LOOPBACK, int(port)
