"""``wire.send_gathered``: the bytes a reader receives are the buffers back to back, whatever
their sizes and however the kernel cuts the ``sendmsg`` calls short (a small send buffer
forces partial sends that stop inside a buffer)."""

from __future__ import annotations

import socket
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.transport import wire


def _received(buffers: list[bytes], sndbuf_bytes: int) -> tuple[bytes, int]:
    # TCP on loopback with a timeout, as the data plane's sockets: non-blocking underneath,
    # so a sendmsg returns after what fits in the send buffer (a blocking one would wait)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf_bytes)
    a.settimeout(30)
    got = bytearray()

    def drain() -> None:
        while chunk := b.recv(1 << 16):
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        sent = wire.send_gathered(a, buffers)
    finally:
        a.shutdown(socket.SHUT_WR)
        reader.join(timeout=30)
        a.close()
        b.close()
    return bytes(got), sent


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 7, 4096, 65_537, 300_000]), min_size=0, max_size=80),
    sndbuf_bytes=st.sampled_from([4096, 1 << 16, 4 << 20]),
)
def test_stream_is_the_buffers_back_to_back(sizes: list[int], sndbuf_bytes: int) -> None:
    buffers = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    got, sent = _received(buffers, sndbuf_bytes)
    assert got == b"".join(buffers)
    assert sent == sum(sizes)


def test_more_buffers_than_one_call_takes() -> None:
    buffers = [memoryview(bytes([i % 256]) * 3) for i in range(wire.GATHER_BUFFERS * 3 + 5)]
    got, sent = _received(buffers, 1 << 16)
    assert got == b"".join(bytes(v) for v in buffers)
    assert sent == 3 * len(buffers)
