"""Credentials across gRPC: the bearer token in call metadata, TLS channels and ports.

Client side: every call carries ``authorization: Bearer <token>`` (``call_metadata``) when
the client was given a token; ``make_channel`` opens a TLS channel when it was given root
certificates, a plaintext one otherwise. Server side: ``principal_of`` reads that metadata
and asks ``Credentials.identify`` (constant-time compares, kvpool/core/auth.py); no
credentials configured means the loopback embedded default, where every caller is
``ANONYMOUS``. A call without a known token is ``Unauthenticated`` before it does anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from kvpool.core.auth import ANONYMOUS, MAX_TOKEN_BYTES, Credentials, Principal, bearer_token
from kvpool.core.errors import InvalidArgument, Unauthenticated

AUTH_KEY = "authorization"

Metadata = tuple[tuple[str, str], ...]


def call_metadata(token: str) -> Metadata | None:
    """The metadata a client sends with every call: the bearer token, or None without one."""
    if not token:
        return None
    if len(token.encode()) > MAX_TOKEN_BYTES or any(c in token for c in "\r\n"):
        raise InvalidArgument(f"token is longer than {MAX_TOKEN_BYTES} bytes or has a line break")
    return ((AUTH_KEY, f"Bearer {token}"),)


def make_channel(
    address: str, options: Sequence[tuple[str, Any]] = (), root_certs: bytes | None = None, aio: bool = False
) -> Any:
    """A channel to ``address``: TLS verified against ``root_certs`` (PEM) when given."""
    if root_certs is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=root_certs)
        if aio:
            return grpc.aio.secure_channel(address, creds, options=list(options))
        return grpc.secure_channel(address, creds, options=list(options))
    if aio:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.insecure_channel(address, options=list(options))


def principal_of(context: grpc.ServicerContext, credentials: Credentials | None) -> Principal:
    """The caller of this call. Without configured credentials: ANONYMOUS (the embedded
    loopback default). With them: the principal whose token the call carries, else
    Unauthenticated (a wrong token and no token get the same answer)."""
    if credentials is None:
        return ANONYMOUS
    token = ""
    for key, value in context.invocation_metadata() or ():
        if key == AUTH_KEY and isinstance(value, str):
            token = bearer_token(value)
            break
    principal = credentials.identify(token) if token else None
    if principal is None:
        raise Unauthenticated(
            "this daemon requires a credential and the call carried none it knows"
            if not token
            else "this daemon does not know the token the call carried",
            hint="pass token=... to the client (the CLI: --token or KVPOOL_TOKEN); the operator lists its "
            "sha256 in the daemon's --credentials file (docs/security.md)",
        )
    return principal


def server_credentials(cert_pem: bytes, key_pem: bytes) -> grpc.ServerCredentials:
    """TLS for a listener from a PEM certificate chain and its private key."""
    return grpc.ssl_server_credentials([(key_pem, cert_pem)])
