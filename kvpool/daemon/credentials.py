"""Moved to ``kvpool.rpc.credentials`` (the directory reads credentials too, and sits below
the daemon); this name stays so existing imports keep working."""

from kvpool.rpc.credentials import MAX_PEM_FILE_BYTES, load_credentials, load_tls, load_token, read_bounded

__all__ = ["MAX_PEM_FILE_BYTES", "load_credentials", "load_tls", "load_token", "read_bounded"]
