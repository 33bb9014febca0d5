"""The same-host call protocol's frames (``kvpool.rpc.local_call``): typed errors cross
intact, malformed frames are refused, the handler context answers as gRPC's would."""

from __future__ import annotations

import socket
import struct
import threading
import time

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.core.errors import ErrorCode, InternalError, InvalidArgument, TenantBusy, error_from_code
from kvpool.rpc.errors import abort_with
from kvpool.rpc.local_call import (
    MAGIC,
    MAX_TEXT_BYTES,
    CallAborted,
    LocalCallClosed,
    LocalCallContext,
    LocalCallKeys,
    check_proof,
    pack_call,
    pack_error,
    pack_proof,
    read_frame,
    send_frame,
    unpack_call,
    unpack_error,
    unpack_hello,
    unpack_token,
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
    key_id, nonce = b"i" * 16, b"n" * 16
    assert unpack_hello(MAGIC + key_id + nonce) == (key_id, nonce)
    for body in (b"KVPL2\0" + key_id + nonce, MAGIC + key_id, MAGIC + key_id + nonce + b"x", b""):
        with pytest.raises(ValueError):
            unpack_hello(body)
    assert unpack_token(b"tok") == "tok"
    for body in (b"t" * 5000, b"\xff\xfe"):
        with pytest.raises(ValueError):
            unpack_token(body)


def test_only_the_daemon_that_issued_a_key_proves_itself_with_it() -> None:
    daemon, other = LocalCallKeys(), LocalCallKeys()
    key_id, key = daemon.issue()
    assert daemon.key_of(key_id) == key and other.key_of(key_id) != key
    assert daemon.issue()[0] != key_id  # a key per Hello: one tenant's key is not another's
    nonce = b"n" * 16
    assert check_proof(pack_proof(daemon.key_of(key_id), nonce, 1234, "node-a"), key, nonce, "node-a", "p") == 1234
    for body in (
        pack_proof(other.key_of(key_id), nonce, 1234, "node-a"),  # a squatter with another secret
        pack_proof(key, b"m" * 16, 1234, "node-a"),  # a proof of another nonce, replayed
        pack_proof(key, nonce, 1234, "node-b"),  # another node's socket
        b"K" + b"\0" * 32,
        b"Kshort",
    ):
        with pytest.raises(LocalCallClosed) as info:
            check_proof(body, key, nonce, "node-a", "p")
        assert info.value.gone and not info.value.sent
    with pytest.raises(LocalCallClosed) as info:  # a passing refusal: the socket is still the daemon's
        check_proof(b"Ebusy", key, nonce, "node-a", "p")
    assert not info.value.gone and "busy" in info.value.message


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


def test_a_frame_larger_than_the_socket_buffer_goes_out_whole() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(10.0)  # a timeout makes the socket non-blocking underneath: sends can be partial
        body = bytes(range(256)) * 8192  # 2 MiB, far past the socket buffer
        got: list[bytes | None] = []
        reader = threading.Thread(target=lambda: got.append(read_frame(b, 1 + len(body))))
        reader.start()
        send_frame(a, b"K", body)
        reader.join(10)
        assert got == [b"K" + body]


def test_a_deadline_bounds_a_trickled_frame() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("<I", 64) + b"x")  # announces 64 bytes, sends one
        with pytest.raises(TimeoutError):  # not a wait for the 63 bytes that never come
            read_frame(b, 64, deadline=time.monotonic() + 0.3)


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
