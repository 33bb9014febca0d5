"""Typed errors: one enum, one class per code, a hint in the text, rebuilt from the wire code."""

from __future__ import annotations

import pytest

from kvpool.core import errors
from kvpool.core.errors import ErrorCode, InternalError, KVPoolError, error_from_code

# gRPC status numbers (part of the gRPC wire protocol).
EXPECTED_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 3,
    ErrorCode.SPEC_MISMATCH: 9,
    ErrorCode.UNKNOWN_NAMESPACE: 5,
    ErrorCode.NOT_FOUND: 5,
    ErrorCode.CAPACITY_EXHAUSTED: 8,
    ErrorCode.LEASE_EXPIRED: 9,
    ErrorCode.CHECKSUM_MISMATCH: 15,
    ErrorCode.UNAVAILABLE: 14,
    ErrorCode.DEADLINE_EXCEEDED: 4,
    ErrorCode.VERSION_MISMATCH: 9,
    ErrorCode.NOT_LEADER: 9,
    ErrorCode.UNSUPPORTED_MODEL: 12,  # UNIMPLEMENTED
    ErrorCode.PERMISSION_DENIED: 7,
    ErrorCode.UNAUTHENTICATED: 16,
    ErrorCode.TENANT_BUSY: 8,  # RESOURCE_EXHAUSTED
    ErrorCode.STORAGE_FAULT: 13,
    ErrorCode.INTERNAL: 13,
}


def test_every_code_has_its_grpc_status() -> None:
    assert set(EXPECTED_STATUS) == set(ErrorCode)
    for code, status in EXPECTED_STATUS.items():
        assert code.grpc_status == status, code


def test_wire_names_are_unique_and_round_trip() -> None:
    names = [code.wire_name for code in ErrorCode]
    assert len(set(names)) == len(names)
    for code in ErrorCode:
        assert ErrorCode.from_wire_name(code.wire_name) is code
    assert ErrorCode.from_wire_name("NO_SUCH_CODE") is ErrorCode.INTERNAL


@pytest.mark.parametrize("code", list(ErrorCode))
def test_error_from_code_rebuilds_a_distinct_class_per_code(code: ErrorCode) -> None:
    err = error_from_code(code, "what happened", "what to do")
    assert isinstance(err, KVPoolError)
    assert err.code is code
    assert err.message == "what happened" and err.hint == "what to do"
    assert str(err) == f"[{code.wire_name}] what happened -- what to do"
    # the class is the one whose class-level code is this code (INTERNAL/STORAGE_FAULT share a status, not a class)
    assert type(err).code is code


def test_each_code_has_exactly_one_exception_class() -> None:
    classes = [
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, KVPoolError) and obj is not KVPoolError
    ]
    assert sorted(c.code.wire_name for c in classes) == sorted(c.wire_name for c in ErrorCode)


def test_str_without_hint_and_code_override() -> None:
    assert str(InternalError("boom")) == "[INTERNAL] boom"
    err = KVPoolError("x", code=ErrorCode.NOT_LEADER)
    assert err.code is ErrorCode.NOT_LEADER and type(err).code is ErrorCode.INTERNAL
