"""A same-host client's connections to its daemon's local-call socket (protocol and why:
``kvpool.rpc.local_call``).

Each connection checks the daemon's proof before it sends the token, then carries one call
at a time. The channel keeps at most ``MAX_CLIENT_CONNECTIONS`` open (a call beyond them,
or one the daemon refuses as busy, goes over gRPC instead, so one client never holds much of
the daemon's connection budget) and reuses them. A forked child never touches its parent's
connections. The caller (``PoolClient``) decides what a ``LocalCallClosed`` means: gRPC for
this call, and no more local calls until the next ``Hello`` when the socket is ``gone``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import threading
import time
from typing import Any

from kvpool.core.errors import DeadlineExceeded
from kvpool.core.unix_path import socket_address
from kvpool.rpc.local_call import (
    MAGIC,
    MAX_PROOF_FRAME_BYTES,
    NONCE_BYTES,
    OK,
    LocalCallClosed,
    check_admitted,
    check_proof,
    frame,
    pack_call,
    read_frame,
    send_frame,
    unpack_error,
)

#: connections one client keeps open at once (calls in flight beyond them use gRPC)
MAX_CLIENT_CONNECTIONS = 16
#: how long a client waits for the daemon's hello answers
HELLO_TIMEOUT_S = 5.0


class _Channel:
    """What both channels keep: where the socket is, the Hello's key, the token, and the
    connections' count; ``_request`` encodes a call within the daemon's frame limit."""

    def __init__(self, path: str, key_id: bytes, key: bytes, token: str, node_id: str, timeout_s: float) -> None:
        self.path = path
        self._key_id = key_id
        self._key = key
        self._token = token.encode()
        self._node_id = node_id
        self._timeout_s = timeout_s
        self._open = 0  # connections open now, idle or carrying a call
        self._closed = False
        self.max_request_bytes = 0  # what the daemon reads in one call (its proof says)

    def _request(self, method: str, request: Any) -> bytes:
        """The call's frame; LocalCallClosed (not sent) when it is over the daemon's limit."""
        head, payload = pack_call(method, request.SerializeToString())
        if self.max_request_bytes and len(head) + len(payload) > self.max_request_bytes:
            raise LocalCallClosed(f"a {len(payload)}-byte {method} request is over the local limit", sent=False)
        return frame(head, payload)

    def _deadline_exceeded(self, method: str) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"the kvpool daemon did not answer {method} in {self._timeout_s} s", hint="is it overloaded?"
        )

    def _gone(self, exc: BaseException) -> LocalCallClosed:
        """The socket is missing or nobody listens: no local calls until the next Hello."""
        return LocalCallClosed(f"the local-call socket {self.path} is gone ({exc})", False, True)

    def _cannot_open(self, exc: BaseException) -> LocalCallClosed:
        return LocalCallClosed(f"cannot open the local-call socket {self.path}: {exc!r}", sent=False)


def _reply(body: bytes, reply_cls: Any) -> Any:
    """A call's answer: its reply, or the daemon's typed error raised."""
    if body[:1] == OK:
        return reply_cls.FromString(body[1:])
    raise unpack_error(body)


class LocalChannel(_Channel):
    """Thread-safe; ``open`` makes the first connection (and so checks the daemon)."""

    def __init__(self, path: str, key_id: bytes, key: bytes, token: str, node_id: str, timeout_s: float) -> None:
        super().__init__(path, key_id, key, token, node_id, timeout_s)
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()  # a forked child shares these sockets: it must not use them

    @classmethod
    def open(cls, path: str, key_id: bytes, key: bytes, token: str, node_id: str, timeout_s: float) -> LocalChannel:
        """A channel whose first connection checked the daemon's proof and was admitted, or
        with no connection yet when the daemon refused it for now (busy: the next call
        tries again); LocalCallClosed when the socket is gone or refuses this client's token."""
        channel = cls(path, key_id, key, token, node_id, timeout_s)
        with channel._lock:
            channel._open += 1
        try:
            channel._release(channel._connect())
        except LocalCallClosed as err:
            if err.gone or err.refused:
                raise
        return channel

    def _connect(self) -> socket.socket:
        """A new admitted connection (the caller has counted it in ``_open``)."""
        conn: socket.socket | None = None
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            deadline = time.monotonic() + min(self._timeout_s, HELLO_TIMEOUT_S)  # the whole hello
            conn.settimeout(deadline - time.monotonic())
            with socket_address(self.path) as address:
                conn.connect(address)
            nonce = os.urandom(NONCE_BYTES)
            send_frame(conn, MAGIC, self._key_id, nonce)
            body = read_frame(conn, MAX_PROOF_FRAME_BYTES, deadline)
            if not body:
                raise ConnectionError("closed during the hello")
            limit = check_proof(body, self._key, nonce, self._node_id, self.path)
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            send_frame(conn, self._token)  # only to the daemon that proved itself
            check_admitted(read_frame(conn, MAX_PROOF_FRAME_BYTES, deadline), self.path)
            conn.settimeout(self._timeout_s)
            self.max_request_bytes = limit
            return conn
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError) as exc:
            self._forget(conn)
            raise self._gone(exc) from None
        except (OSError, ValueError) as exc:
            self._forget(conn)
            raise self._cannot_open(exc) from None
        except BaseException:
            self._forget(conn)
            raise

    def _forget(self, conn: socket.socket | None) -> None:
        if conn is not None:
            conn.close()
        with self._lock:
            self._open -= 1

    def _take(self, fresh: bool) -> tuple[socket.socket, bool]:
        """(a connection, whether it was idle); LocalCallClosed if none can be had now."""
        with self._lock:
            if self._closed:
                raise LocalCallClosed("the local channel is closed", sent=False)
            if os.getpid() != self._pid:  # its frames would interleave with the parent's
                raise LocalCallClosed("the local channel was opened by the parent of this process", sent=False)
            if self._idle and not fresh:
                return self._idle.pop(), True
            if self._open >= MAX_CLIENT_CONNECTIONS:
                raise LocalCallClosed(f"{MAX_CLIENT_CONNECTIONS} local calls in flight", sent=False)
            self._open += 1
        return self._connect(), False

    def _release(self, conn: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        self._forget(conn)

    def call(self, method: str, request: Any, reply_cls: Any, max_reply_bytes: int) -> Any:
        """The reply to ``method(request)``; the daemon's typed error; DeadlineExceeded after
        the channel's timeout; LocalCallClosed if no connection could carry it or it broke
        (``sent``: the daemon may have run it). An idle connection found closed before the
        request left is replaced once; a request larger than the daemon reads in one call
        is not sent here (gRPC answers it, with the same limit's error)."""
        data = self._request(method, request)
        for fresh in (False, True):
            conn, reused = self._take(fresh)
            sent = False
            try:
                conn.sendall(data)
                sent = True
                body = read_frame(conn, max_reply_bytes + 1)
                if not body:
                    raise ConnectionError("the daemon closed the connection before answering")
            except TimeoutError:
                self._forget(conn)  # its answer may still come: the connection is out of step
                raise self._deadline_exceeded(method) from None
            except (OSError, ValueError) as exc:
                self._forget(conn)
                if reused and not sent:
                    continue
                raise LocalCallClosed(f"local call {method} failed: {exc}", sent=sent) from None
            except BaseException:
                self._forget(conn)
                raise
            self._release(conn)
            return _reply(body, reply_cls)
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
        for conn in idle:
            with contextlib.suppress(OSError):
                conn.close()


class AsyncLocalChannel(_Channel):
    """The asyncio twin of ``LocalChannel`` for one event loop (``AsyncPoolClient``): the
    same hello, proof, limits and ``LocalCallClosed`` semantics, over asyncio streams."""

    def __init__(self, path: str, key_id: bytes, key: bytes, token: str, node_id: str, timeout_s: float) -> None:
        super().__init__(path, key_id, key, token, node_id, timeout_s)
        self._idle: list[Stream] = []

    @classmethod
    async def open(
        cls, path: str, key_id: bytes, key: bytes, token: str, node_id: str, timeout_s: float
    ) -> AsyncLocalChannel:
        channel = cls(path, key_id, key, token, node_id, timeout_s)
        channel._open += 1
        try:
            channel._release(await channel._connect())
        except LocalCallClosed as err:  # as LocalChannel.open: a busy daemon is asked again later
            if err.gone or err.refused:
                raise
        return channel

    async def _connect(self) -> Stream:
        """A new admitted connection (the caller has counted it in ``_open``)."""
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(min(self._timeout_s, HELLO_TIMEOUT_S)):
                with socket_address(self.path) as address:
                    reader, writer = await asyncio.open_unix_connection(address)
                nonce = os.urandom(NONCE_BYTES)
                writer.write(frame(MAGIC, self._key_id, nonce))
                body = await read_frame_async(reader, MAX_PROOF_FRAME_BYTES)
                limit = check_proof(body, self._key, nonce, self._node_id, self.path)
                writer.write(frame(self._token))  # only to the daemon that proved itself
                check_admitted(await read_frame_async(reader, MAX_PROOF_FRAME_BYTES), self.path)
            self.max_request_bytes = limit
            return reader, writer
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError) as exc:
            self._forget(writer)
            raise self._gone(exc) from None
        except (OSError, ValueError, asyncio.IncompleteReadError) as exc:  # TimeoutError is an OSError
            self._forget(writer)
            raise self._cannot_open(exc) from None
        except BaseException:
            self._forget(writer)
            raise

    def _forget(self, writer: asyncio.StreamWriter | None) -> None:
        if writer is not None:
            writer.close()
        self._open -= 1

    async def _take(self, fresh: bool) -> tuple[Stream, bool]:
        if self._closed:
            raise LocalCallClosed("the local channel is closed", sent=False)
        if self._idle and not fresh:
            return self._idle.pop(), True
        if self._open >= MAX_CLIENT_CONNECTIONS:
            raise LocalCallClosed(f"{MAX_CLIENT_CONNECTIONS} local calls in flight", sent=False)
        self._open += 1
        return await self._connect(), False

    def _release(self, stream: Stream) -> None:
        if self._closed:
            self._forget(stream[1])
        else:
            self._idle.append(stream)

    async def call(self, method: str, request: Any, reply_cls: Any, max_reply_bytes: int) -> Any:
        """As ``LocalChannel.call``, awaited; a cancelled call closes its connection."""
        data = self._request(method, request)
        for fresh in (False, True):
            (reader, writer), reused = await self._take(fresh)
            sent = False
            try:
                async with asyncio.timeout(self._timeout_s):
                    writer.write(data)
                    await writer.drain()
                    sent = True
                    body = await read_frame_async(reader, max_reply_bytes + 1)
            except TimeoutError:
                self._forget(writer)
                raise self._deadline_exceeded(method) from None
            except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
                self._forget(writer)
                if reused and not sent:
                    continue
                raise LocalCallClosed(f"local call {method} failed: {exc!r}", sent=sent) from None
            except BaseException:
                self._forget(writer)
                raise
            self._release((reader, writer))
            return _reply(body, reply_cls)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for _, writer in idle:
            self._forget(writer)


#: an asyncio connection: its reader and writer
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def read_frame_async(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    """The next frame's body (IncompleteReadError if the peer closes first, ValueError if it
    is larger than ``max_bytes``)."""
    (size,) = struct.unpack("<I", await reader.readexactly(4))
    if size > max_bytes:
        raise ValueError(f"a {size}-byte frame; the limit is {max_bytes}")
    body = await reader.readexactly(size)
    if not body:
        raise ValueError("an empty frame")
    return body
