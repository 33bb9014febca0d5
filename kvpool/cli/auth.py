"""Make credentials for a daemon's --credentials file (docs/security.md).

  kvpool auth new-token            a fresh random token and the sha256 the file stores
  kvpool auth hash-token           the sha256 of a token read from stdin (one line)

Give the token to the tenant (it passes it as ``token=`` / ``--token`` / ``KVPOOL_TOKEN``);
put only its sha256 in the credentials file.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["new-token", "hash-token"], help="what to make")
    parser.add_argument("--json", action="store_true", help="machine-readable JSON output")


def run(args: argparse.Namespace) -> int:
    from kvpool.core.auth import MAX_TOKEN_BYTES, new_token, token_sha256

    if args.what == "new-token":
        token = new_token()
    else:
        token = sys.stdin.readline(MAX_TOKEN_BYTES + 1).strip()
        if not token or len(token.encode()) > MAX_TOKEN_BYTES:
            print(f"kvpool auth: expected one token of 1..{MAX_TOKEN_BYTES} bytes on stdin", file=sys.stderr)
            return 1
    digest = token_sha256(token)
    if args.json:
        print(
            json.dumps(
                {"token": token, "token_sha256": digest} if args.what == "new-token" else {"token_sha256": digest}
            )
        )
    elif args.what == "new-token":
        print(f"token:        {token}\ntoken_sha256: {digest}")
    else:
        print(digest)
    return 0
