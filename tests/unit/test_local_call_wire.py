"""The same-host call protocol's frames (``kvpool.rpc.local_call``): typed errors cross
intact, malformed frames are refused, the handler context answers as gRPC's would."""

from __future__ import annotations

import socket

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.core.errors import ErrorCode, InternalError, InvalidArgument, TenantBusy, error_from_code
from kvpool.rpc.errors import abort_with
from kvpool.rpc.local_call import (
    HELLO_MAGIC,
    MAX_HELLO_BYTES,
    MAX_TEXT_BYTES,
    CallAborted,
    LocalCallContext,
    pack_call,
    pack_error,
    read_frame,
    send_frame,
    unpack_call,
    unpack_error,
    unpack_hello,
)


@given(code=st.sampled_from(list(ErrorCode)), message=st.text(max_size=300), hint=st.text(max_size=300))
def test_a_typed_error_crosses_with_its_type_message_and_hint(code: ErrorCode, message: str, hint: str) -> None:
    err = unpack_error(pack_error(error_from_code(code, message, hint)))
    assert err.code is code and type(err) is type(error_from_code(code, ""))
    assert err.message == message and err.hint == hint


def test_long_texts_are_cut_and_malformed_errors_are_typed() -> None:
    err = unpack_error(pack_error(InternalError("x" * (3 * MAX_TEXT_BYTES))))
    assert len(err.message) == MAX_TEXT_BYTES
    for body in (b"E", b"E\x05AB", b"E\x03ABC\xff\xff", b"E\x00\x00\x00\x01\x00"):
        assert isinstance(unpack_error(body), InvalidArgument)


@given(method=st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=255),
       request=st.binary(max_size=256))  # fmt: skip
def test_a_call_frame_names_its_method_and_carries_its_request(method: str, request: bytes) -> None:
    head, payload = pack_call(method, request)
    assert unpack_call(head + payload) == (method, request)


def test_bad_call_and_hello_frames_are_refused() -> None:
    for body in (b"", b"\x00abc", b"\x09Lookup"):
        with pytest.raises(ValueError):
            unpack_call(body)
    with pytest.raises(InvalidArgument):
        pack_call("x" * 256, b"")
    assert unpack_hello(HELLO_MAGIC + b"tok") == "tok"
    for body in (b"KVPL2\0tok", b"tok", HELLO_MAGIC + b"t" * MAX_HELLO_BYTES):
        with pytest.raises(ValueError):
            unpack_hello(body)


def test_frames_cross_a_socket_and_an_oversized_one_is_refused_unread() -> None:
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, b"K", b"hello")
        assert read_frame(b, 16) == b"Khello"
        send_frame(a, b"x" * 17)
        with pytest.raises(ValueError):
            read_frame(b, 16)
        a.close()
        b.recv(1 << 10)  # the refused frame's body, never read as a frame
        assert read_frame(b, 16) is None  # the peer closed between frames


def test_the_context_answers_as_grpcs_does_for_an_abort() -> None:
    context = LocalCallContext((("authorization", "Bearer t"),))
    assert context.invocation_metadata() == (("authorization", "Bearer t"),)
    assert context.code() is None and context.is_active()
    with pytest.raises(CallAborted):
        abort_with(context, TenantBusy("busy", hint="retry"))  # type: ignore[arg-type]
    assert context.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    err = context.error()
    assert isinstance(err, TenantBusy) and err.message == "busy" and err.hint == "retry"
    assert LocalCallContext(None).invocation_metadata() == ()
