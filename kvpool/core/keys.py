"""Block keys: the identity of a stored block is ``(namespace digest, block hash)``.

Why one 32-byte key (``namespace digest || hash``) rather than a namespace check in every
call: every store, index, directory and event map keys of this one shape, so a caller's
hash can only ever reach a block of the caller's own namespace. There is no code path
where a hash alone names a block, so there is no check to forget: tenant B asking for
A's hash asks for ``B || hash``, which is a different key (a miss), and B's put under A's
hash creates ``B || hash`` beside A's block instead of replacing or shadowing it.

Wire messages keep carrying a namespace and ``n x 16``-byte hashes (``kvpool-h1``);
the daemon builds the keys right after decoding and splits them right before encoding.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvpool.core.errors import InvalidArgument
from kvpool.core.hashing import HASH_BYTES

NAMESPACE_BYTES = 16
BLOCK_KEY_BYTES = NAMESPACE_BYTES + HASH_BYTES


def check_namespace(namespace: bytes) -> bytes:
    """The 16-byte namespace digest, or InvalidArgument (a typed error, never a crash)."""
    if len(namespace) != NAMESPACE_BYTES:
        raise InvalidArgument(
            f"namespace digest must be {NAMESPACE_BYTES} bytes, got {len(namespace)}",
            hint="send Namespace.digest(), as PoolClient does",
        )
    return namespace


def block_keys(namespace: bytes, hashes: Iterable[bytes]) -> list[bytes]:
    """The store keys of ``hashes`` in ``namespace``."""
    check_namespace(namespace)
    return [namespace + h for h in hashes]


def block_key(namespace: bytes, block_hash: bytes) -> bytes:
    return namespace + block_hash


def key_namespace(key: bytes) -> bytes:
    return key[:NAMESPACE_BYTES]


def key_hash(key: bytes) -> bytes:
    return key[NAMESPACE_BYTES:]


def hashes_of(keys: Sequence[bytes]) -> list[bytes]:
    """The block hashes of keys (all of one namespace, which the caller already knows)."""
    return [k[NAMESPACE_BYTES:] for k in keys]


def group_by_namespace(keys: Iterable[bytes]) -> dict[bytes, list[bytes]]:
    """namespace -> its hashes, in the keys' order (events name one namespace each)."""
    out: dict[bytes, list[bytes]] = {}
    for key in keys:
        out.setdefault(key[:NAMESPACE_BYTES], []).append(key[NAMESPACE_BYTES:])
    return out
