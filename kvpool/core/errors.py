"""Typed errors: one enum, mapped 1:1 to gRPC status codes.

Every error carries what the user must do (``hint``). The rpc layer turns an
``ErrorCode`` into a gRPC status and back, so a client sees the same typed error
the daemon raised. This module imports nothing from grpc: the mapping holds the
numeric gRPC status codes, which are part of the gRPC wire protocol and stable.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Every failure kvpool reports. Value = (name on the wire, gRPC status code)."""

    INVALID_ARGUMENT = ("INVALID_ARGUMENT", 3)  # malformed request, wrong shape/dtype
    SPEC_MISMATCH = ("SPEC_MISMATCH", 9)  # FAILED_PRECONDITION: layouts/models differ
    UNKNOWN_NAMESPACE = ("UNKNOWN_NAMESPACE", 5)  # NOT_FOUND
    NOT_FOUND = ("NOT_FOUND", 5)
    CAPACITY_EXHAUSTED = ("CAPACITY_EXHAUSTED", 8)  # RESOURCE_EXHAUSTED
    LEASE_EXPIRED = ("LEASE_EXPIRED", 9)  # FAILED_PRECONDITION
    CHECKSUM_MISMATCH = ("CHECKSUM_MISMATCH", 15)  # DATA_LOSS
    UNAVAILABLE = ("UNAVAILABLE", 14)  # daemon down / unreachable
    DEADLINE_EXCEEDED = ("DEADLINE_EXCEEDED", 4)
    VERSION_MISMATCH = ("VERSION_MISMATCH", 9)  # scheme or protocol version differs
    NOT_LEADER = ("NOT_LEADER", 9)  # talk to the leader instead
    UNSUPPORTED_MODEL = ("UNSUPPORTED_MODEL", 12)  # UNIMPLEMENTED: the pool cannot hold this model's KV exactly
    PERMISSION_DENIED = ("PERMISSION_DENIED", 7)  # a namespace / admin call this credential does not allow
    UNAUTHENTICATED = ("UNAUTHENTICATED", 16)  # no credential, or one the daemon does not know
    TENANT_BUSY = ("TENANT_BUSY", 8)  # RESOURCE_EXHAUSTED: this tenant has its share in flight; retry shortly
    STORAGE_FAULT = ("STORAGE_FAULT", 13)  # INTERNAL: disk full, unwritable dir, corrupt index
    INTERNAL = ("INTERNAL", 13)

    @property
    def wire_name(self) -> str:
        """The code's name on the wire (trailing metadata ``kvpool-error-code``)."""
        return self.value[0]

    @property
    def grpc_status(self) -> int:
        """The number of the gRPC status code this error travels as."""
        return self.value[1]

    @classmethod
    def from_wire_name(cls, name: str) -> ErrorCode:
        """The code a wire name names (unknown names become INTERNAL)."""
        for code in cls:
            if code.wire_name == name:
                return code
        return cls.INTERNAL


class KVPoolError(Exception):
    """Base of every error kvpool raises on purpose.

    ``hint`` says what the caller should do about it; ``str(err)`` includes it.
    """

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, hint: str = "", code: ErrorCode | None = None) -> None:
        """``message`` says what happened; ``hint`` what the caller should do about it."""
        if code is not None:
            self.code = code
        self.message = message
        self.hint = hint
        super().__init__(self.__str__())

    def __str__(self) -> str:
        text = f"[{self.code.wire_name}] {self.message}"
        if self.hint:
            text += f" -- {self.hint}"
        return text


class InvalidArgument(KVPoolError):
    """The request itself is wrong (a size, a shape, a limit): fix it; retrying will not help."""

    code = ErrorCode.INVALID_ARGUMENT


class SpecMismatch(KVPoolError):
    """Client and daemon disagree on a KVSpec (layout, dtype, digest): the same namespace must mean the same
    bytes.
    """

    code = ErrorCode.SPEC_MISMATCH


class UnsupportedModel(KVPoolError):
    """A model (or engine configuration) whose KV the pool cannot hold exactly.

    Raised by the engine connectors before any prompt runs, so an unsupported model is never
    served wrong KV; the hint says what to do instead.
    """

    code = ErrorCode.UNSUPPORTED_MODEL


class UnknownNamespace(KVPoolError):
    """The node does not know this namespace (it restarted or retired it): say hello again (the clients do)."""

    code = ErrorCode.UNKNOWN_NAMESPACE


class NotFound(KVPoolError):
    """What the call names does not exist (a lease, a put, a route)."""

    code = ErrorCode.NOT_FOUND


class CapacityExhausted(KVPoolError):
    """A bound is reached (memory, leases, puts, namespaces, a quota) and nothing can be evicted to make room."""

    code = ErrorCode.CAPACITY_EXHAUSTED


class LeaseExpired(KVPoolError):
    """The read lease ended (its TTL passed) before the bytes were used: read again."""

    code = ErrorCode.LEASE_EXPIRED


class ChecksumMismatch(KVPoolError):
    """Bytes failed their checksum: the block is treated as a miss and recomputed, never served."""

    code = ErrorCode.CHECKSUM_MISMATCH


class Unavailable(KVPoolError):
    """The daemon (or a peer, or etcd) cannot be reached; the message names the address."""

    code = ErrorCode.UNAVAILABLE


class DeadlineExceeded(KVPoolError):
    """The call did not finish within its timeout."""

    code = ErrorCode.DEADLINE_EXCEEDED


class VersionMismatch(KVPoolError):
    """Client and daemon speak different protocol or hash-scheme versions: use one kvpool version."""

    code = ErrorCode.VERSION_MISMATCH


class NotLeader(KVPoolError):
    """This directory instance is a standby: ask the leader (clients follow it through etcd)."""

    code = ErrorCode.NOT_LEADER


class PermissionDenied(KVPoolError):
    """The credential may not do this (another tenant's namespace, an admin view)."""

    code = ErrorCode.PERMISSION_DENIED


class Unauthenticated(KVPoolError):
    """The daemon requires a credential and the call carried none it knows (docs/security.md)."""

    code = ErrorCode.UNAUTHENTICATED


class TenantBusy(KVPoolError):
    """The caller's tenant already has its share of the daemon in flight (per-tenant
    fairness, docs/security.md): nothing was done; retry after a short backoff, or send
    smaller batches."""

    code = ErrorCode.TENANT_BUSY


class StorageFault(KVPoolError):
    """A tier's storage failed (I/O error, disk full); the tier reports it and the node keeps serving from the
    others.
    """

    code = ErrorCode.STORAGE_FAULT


class InternalError(KVPoolError):
    """A bug: the daemon logged it (rate-limited) and kept serving."""

    code = ErrorCode.INTERNAL


_BY_CODE: dict[ErrorCode, type[KVPoolError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        SpecMismatch,
        UnsupportedModel,
        UnknownNamespace,
        NotFound,
        CapacityExhausted,
        LeaseExpired,
        ChecksumMismatch,
        Unavailable,
        DeadlineExceeded,
        VersionMismatch,
        NotLeader,
        PermissionDenied,
        Unauthenticated,
        TenantBusy,
        StorageFault,
        InternalError,
    )
}


def error_from_code(code: ErrorCode, message: str, hint: str = "") -> KVPoolError:
    """Rebuild the typed exception for ``code`` (used by the rpc layer on the client side)."""
    return _BY_CODE.get(code, InternalError)(message, hint=hint, code=code)
