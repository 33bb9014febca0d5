"""Reading the files credentials live in (for the composition roots: the daemon, the directory).

Every file is read with a size bound, and a file that cannot be read or parsed stops the
process at start with the path and the reason, never later on the first call.
"""

from __future__ import annotations

import grpc

from kvpool.core.auth import MAX_CREDENTIALS_FILE_BYTES, MAX_TOKEN_BYTES, Credentials, parse_credentials
from kvpool.core.errors import InvalidArgument
from kvpool.rpc.auth import server_credentials

#: largest TLS certificate chain or key file read, in bytes
MAX_PEM_FILE_BYTES = 1 << 20


def read_bounded(path: str, limit_bytes: int, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit_bytes + 1)
    except OSError as exc:
        raise InvalidArgument(f"cannot read the {what} {path}: {exc}") from None
    if len(data) > limit_bytes:
        raise InvalidArgument(f"the {what} {path} is larger than {limit_bytes} bytes")
    return data


def load_credentials(path: str) -> Credentials | None:
    """The credentials file's principals (None without a file: the loopback default)."""
    if not path:
        return None
    data = read_bounded(path, MAX_CREDENTIALS_FILE_BYTES, "credentials file")
    try:
        return parse_credentials(data, toml=path.endswith(".toml"))
    except InvalidArgument as err:
        raise InvalidArgument(f"{path}: {err.message}", hint=err.hint or "see docs/security.md") from None


def load_token(path: str, what: str = "cluster token file") -> str:
    """A token kept in a file (one line; "" without a file). A file, not a flag or an
    environment variable, so the token does not show in ``ps`` or ``/proc/PID/environ``."""
    if not path:
        return ""
    token = read_bounded(path, MAX_TOKEN_BYTES + 2, what).decode("utf-8", "replace").strip()
    if not token or len(token.encode()) > MAX_TOKEN_BYTES or "\n" in token:
        raise InvalidArgument(f"the {what} {path} must hold one token of 1..{MAX_TOKEN_BYTES} bytes")
    return token


def load_root_certs(path: str, what: str = "CA certificate") -> bytes | None:
    """The PEM root certificates a client verifies a TLS server against (None without a
    file: the client dials in plaintext)."""
    if not path:
        return None
    return read_bounded(path, MAX_PEM_FILE_BYTES, what)


def load_tls(cert_file: str, key_file: str) -> grpc.ServerCredentials | None:
    """TLS credentials for a listener (None without a certificate: plaintext)."""
    if not cert_file:
        return None
    cert = read_bounded(cert_file, MAX_PEM_FILE_BYTES, "TLS certificate")
    key = read_bounded(key_file, MAX_PEM_FILE_BYTES, "TLS key")
    return server_credentials(cert, key)
