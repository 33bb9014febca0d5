"""Pick a data-plane implementation by name: "tcp" always works; "ucx" uses ucxx and
falls back to tcp (with a warning naming why) when ucxx cannot be imported; "nixl" uses
NIXL and refuses with the install command when it is missing (no silent fallback: an
operator who asked for NIXL wants its fabric, and would otherwise measure TCP)."""

from __future__ import annotations

import logging
import ssl

from kvpool.core.auth import Credentials
from kvpool.core.errors import InvalidArgument
from kvpool.transport.base import BlockStore, DataServer, Transport
from kvpool.transport.shares import TransferShares
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_server import TcpDataServer

log = logging.getLogger("kvpool.transport")

TRANSPORTS = ("tcp", "ucx", "nixl")


def ucx_available() -> str:
    """'' when ucxx imports, else why not."""
    try:
        import ucxx._lib.libucxx  # noqa: F401
    except Exception as exc:  # ImportError, or a missing libucx at load time
        return f"{type(exc).__name__}: {exc}"
    return ""


def nixl_available() -> str:
    """'' when NIXL's bindings import, else why not (``kvpool.transport.nixl`` imports them lazily)."""
    from kvpool.transport.nixl import nixl_available as why_not

    return why_not()


def _check_kind(kind: str) -> None:
    if kind not in TRANSPORTS:
        raise InvalidArgument(f"unknown transport {kind!r}", hint=f"use one of {', '.join(TRANSPORTS)}")


def make_data_server(
    kind: str,
    store: BlockStore,
    listen: str,
    credentials: Credentials | None = None,
    tls: ssl.SSLContext | None = None,
    shares: TransferShares | None = None,
) -> DataServer:
    """``credentials``: peers must pass AUTH first (docs/security.md); None admits every peer.
    ``tls``: every connection is TLS (``tls.server_tls_context``; UCX / NIXL bytes are not).
    ``shares``: per-tenant bounds on TCP transfers in flight (``shares.py``); None = ungated."""
    server = _make_data_server(kind, store, listen, credentials)
    server.tls_context = tls
    server.shares = shares
    return server


def _make_data_server(kind: str, store: BlockStore, listen: str, credentials: Credentials | None) -> TcpDataServer:
    _check_kind(kind)
    if kind == "nixl":
        from kvpool.transport.nixl import NixlDataServer, require_nixl

        require_nixl()
        return NixlDataServer(store, listen, credentials=credentials)
    if kind == "ucx":
        why = ucx_available()
        if not why:
            from kvpool.transport.ucx import UcxDataServer

            return UcxDataServer(store, listen, credentials=credentials)
        log.warning("ucx data plane unavailable (%s): using tcp", why)
    return TcpDataServer(store, listen, credentials=credentials)


def make_transport(kind: str, timeout_s: float = 10.0, streams: int = 0) -> Transport:
    """A reader of ``kind``. A node with credentials admits its connections with a ticket its
    control plane issued (``Transport.use_tickets``), never with the token itself.
    ``streams``: the most connections one large read is spread over (0 = the data plane's
    default: 1 for tcp, one per core up to 4 for ucx and nixl; ``kvpool.transport.tcp``)."""
    _check_kind(kind)
    if kind == "nixl":
        from kvpool.transport.nixl import NixlTransport, require_nixl

        require_nixl()
        return NixlTransport(timeout_s=timeout_s, streams=streams)
    if kind == "ucx":
        why = ucx_available()
        if not why:
            from kvpool.transport.ucx import UcxTransport

            return UcxTransport(timeout_s=timeout_s, streams=streams)
        log.warning("ucx data plane unavailable (%s): using tcp", why)
    return TcpTransport(timeout_s=timeout_s, streams=streams)
