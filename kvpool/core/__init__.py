"""Core types: keys, hashing, KVSpec, errors, config types, clock. stdlib + numpy + xxhash only
(plus the optional C kernel of checksum.py)."""

from kvpool.core.checksum import checksum64
from kvpool.core.clock import Clock, FakeClock, MonotonicClock
from kvpool.core.config import DaemonConfig, StoreConfig
from kvpool.core.errors import (
    CapacityExhausted,
    ChecksumMismatch,
    ErrorCode,
    InvalidArgument,
    KVPoolError,
    LeaseExpired,
    NotFound,
    SpecMismatch,
    StorageFault,
    Unavailable,
    UnknownNamespace,
    VersionMismatch,
)
from kvpool.core.hashing import HASH_BYTES, HASH_SCHEME, block_hashes, chain_hashes
from kvpool.core.spec import KVSpec, Namespace

__all__ = [
    "HASH_BYTES",
    "HASH_SCHEME",
    "CapacityExhausted",
    "ChecksumMismatch",
    "Clock",
    "DaemonConfig",
    "ErrorCode",
    "FakeClock",
    "InvalidArgument",
    "KVPoolError",
    "KVSpec",
    "LeaseExpired",
    "MonotonicClock",
    "Namespace",
    "NotFound",
    "SpecMismatch",
    "StorageFault",
    "StoreConfig",
    "Unavailable",
    "UnknownNamespace",
    "VersionMismatch",
    "block_hashes",
    "chain_hashes",
    "checksum64",
]
