"""Same-host control calls over the daemon's Unix socket (``kvpool.rpc.local_call``) against
real daemons: a client uses it when offered, gets the same answers and the same tenancy as
over gRPC, goes back to gRPC when it breaks, and finds the new socket after a restart; a
stranger's bytes on the socket cost the daemon nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import socket
import stat
import struct
import threading
import time
import urllib.request
from typing import Any

import numpy as np
import pytest
from conftest import DaemonHandle, free_port, start_daemon
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_auth import SPEC, TOKEN_A, TOKEN_B, write_credentials

from kvpool import AsyncPoolClient, PoolClient
from kvpool.core.errors import PermissionDenied, Unavailable, UnknownNamespace
from kvpool.daemon.local_calls import MAX_LOCAL_CONNECTIONS, MAX_TENANT_CONNECTIONS
from kvpool.proto import pool_pb2
from kvpool.rpc.local_call import MAGIC, LocalCallClosed, pack_call, read_frame, send_frame
from kvpool.rpc.local_channel import LocalChannel

TOKENS = list(range(7000, 7000 + 16 * 8))


def make_blocks(n: int, seed: int) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 2**16, size=(n, *SPEC.block_shape), dtype=np.uint16)
    return raw.view(np.float16)


def local_count(metrics_address: str, method: str, service: str = "pool-local") -> float:
    """``kvpool_rpc_duration_seconds_count`` of ``method`` answered OK on ``service``."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    want = f'kvpool_rpc_duration_seconds_count{{code="OK",method="{method}",service="{service}"}}'
    for line in text.splitlines():
        if line.startswith(want):
            return float(line.split()[-1])
    return 0.0


def test_a_same_host_client_calls_over_the_local_socket() -> None:
    metrics_address = f"127.0.0.1:{free_port()}"
    daemon = start_daemon("--metrics-listen", metrics_address)
    try:
        with PoolClient.connect(daemon.address, SPEC, salt=b"s") as client:
            assert client._local is not None
            path = client._local.path
            assert pathlib.Path(path).parent == pathlib.Path(daemon.arena_dir)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # the daemon's uid only
            hashes, blocks = client.hashes(TOKENS), make_blocks(8, seed=1)
            assert client.put(hashes, blocks).stored == 8
            assert client.lookup(hashes) == 8
            assert client.get(hashes).tobytes() == blocks.tobytes()
            assert client.pin(hashes[:2]) == 2
            assert client.remove(hashes[6:]) == 2
            assert client.lookup(hashes) == 6
            stats = client.stats()
            assert stats["local_socket"] == path and stats["local_connections_open"] >= 1
            assert stats["local_connections_served"] >= 1 and stats["local_connections_refused"] == 0
            with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as reply:
                text = reply.read().decode()
            assert "kvpool_local_connections 1.0" in text and "kvpool_local_connections_admitted_total 1.0" in text
        # the calls went over the socket; Hello, which names it, over gRPC
        assert local_count(metrics_address, "Lookup") == 2
        assert local_count(metrics_address, "PutStart") == 1
        assert local_count(metrics_address, "Lookup", service="pool") == 0
        assert local_count(metrics_address, "Hello", service="pool") == 1
    finally:
        daemon.cleanup()
    assert not pathlib.Path(path).exists()  # removed at stop


def test_local_calls_off_serves_gRPC_only(daemon_factory: Any) -> None:
    daemon = daemon_factory("--local-calls", "off")
    with PoolClient.connect(daemon.address, SPEC, salt=b"s") as client:
        assert client._local is None
        hashes = client.hashes(TOKENS[:32])
        assert client.put(hashes, make_blocks(2, seed=2)).stored == 2
        assert client.lookup(hashes) == 2
    assert not [p for p in os.listdir(daemon.arena_dir) if p.endswith(".sock")]


def test_the_local_socket_keeps_tenants_apart(daemon_factory: Any, tmp_path: pathlib.Path) -> None:
    daemon = daemon_factory("--credentials", write_credentials(str(tmp_path)))
    with (
        PoolClient.connect(daemon.address, SPEC, salt=b"salt-a", token=TOKEN_A) as a,
        PoolClient.connect(daemon.address, SPEC, salt=b"salt-b", token=TOKEN_B) as b,
    ):
        assert a._local is not None and b._local is not None
        hashes = a.hashes(TOKENS)
        assert a.put(hashes, make_blocks(8, seed=3)).stored == 8
        assert b.lookup(hashes) == 0 and b.remove(hashes) == 0  # B's namespace: none of A's blocks
        # B naming A's namespace on the socket: refused, as over gRPC
        request = pool_pb2.HashesRequest(namespace=a.namespace.digest(), hashes=b"".join(hashes))
        with pytest.raises(PermissionDenied):
            b._local.call("Lookup", request, pool_pb2.LookupReply, 1 << 20)
        with pytest.raises(PermissionDenied):
            b._local.call("Remove", request, pool_pb2.RemoveReply, 1 << 20)
        assert a.lookup(hashes) == 8
        # a connection without a known token is refused at its hello (with A's key: the
        # daemon proves itself to anyone with a key, the token decides)
        for token in ("", "kvp_not-a-token", TOKEN_A + "x"):
            with pytest.raises(LocalCallClosed, match="unauthenticated") as info:
                LocalChannel.open(a._local.path, a._local._key_id, a._local._key, token, a.node_id, 5.0)
            assert not info.value.gone
        assert a.lookup(hashes) == 8


def test_a_killed_daemon_is_unavailable_and_a_restarted_one_found_again() -> None:
    daemon = start_daemon()
    try:
        client = PoolClient.connect(daemon.address, SPEC, salt=b"s", timeout_s=5.0)
        hashes = client.hashes(TOKENS[:64])
        assert client.put(hashes, make_blocks(4, seed=4)).stored == 4
        assert client._local is not None
        old_path = client._local.path
        daemon.kill()
        with pytest.raises(Unavailable):
            client.lookup(hashes)
        assert client._local is None  # back to gRPC until the next hello
        daemon = start_daemon(port=daemon.port)
        deadline = time.monotonic() + 15  # gRPC's reconnect backoff after the refused call above
        while True:
            try:
                assert client.lookup(hashes) == 0  # UnknownNamespace -> hello again -> the new socket
                break
            except Unavailable:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert client._local is not None and client._local.path != old_path
        assert client.put(hashes, make_blocks(4, seed=4)).stored == 4
        assert client.lookup(hashes) == 4
        client.close()
    finally:
        daemon.cleanup()


def test_unknown_namespace_on_the_socket_is_typed(pool_daemon: DaemonHandle) -> None:
    with PoolClient.connect(pool_daemon.address, SPEC, salt=b"s") as client:
        assert client._local is not None
        request = pool_pb2.HashesRequest(namespace=b"\x01" * 16, hashes=b"\x02" * 16)
        with pytest.raises(UnknownNamespace):
            client._local.call("Lookup", request, pool_pb2.LookupReply, 1 << 20)


def test_a_forked_child_does_not_use_its_parents_connections(pool_daemon: DaemonHandle) -> None:
    with PoolClient.connect(pool_daemon.address, SPEC, salt=b"s") as client:
        hashes = client.hashes(TOKENS[:64])
        assert client.put(hashes, make_blocks(4, seed=6)).stored == 4
        local = client._local
        assert local is not None
        request = pool_pb2.HashesRequest(namespace=client.namespace.digest(), hashes=b"".join(hashes))
        pid = os.fork()
        if pid == 0:  # the child: refused before it touches a socket it shares with its parent
            try:
                local.call("Lookup", request, pool_pb2.LookupReply, 1 << 20)
                os._exit(1)
            except LocalCallClosed as err:
                os._exit(0 if not err.sent else 2)
            except BaseException:
                os._exit(3)
        for _ in range(20):  # the parent's calls meanwhile stay in step
            assert local.call("Lookup", request, pool_pb2.LookupReply, 1 << 20).hits == 4
        assert os.waitpid(pid, 0)[1] == 0


def test_a_request_larger_than_the_socket_buffer_is_answered(pool_daemon: DaemonHandle) -> None:
    with PoolClient.connect(pool_daemon.address, SPEC, salt=b"s", timeout_s=5.0) as client:
        hashes = [os.urandom(16) for _ in range(20_000)]  # a 320 KB request
        assert client._local is not None
        assert client.lookup(hashes) == 0 and client._local is not None


def test_a_squatter_on_a_stale_socket_name_gets_no_token(daemon_factory: Any, tmp_path: pathlib.Path) -> None:
    """The daemon stops; another process binds its socket's name (the arena directory is
    /dev/shm, writable by every user): the client's next call must not hand it the token,
    nor take its answers."""
    daemon = daemon_factory("--credentials", write_credentials(str(tmp_path)))
    client = PoolClient.connect(daemon.address, SPEC, salt=b"salt-a", token=TOKEN_A, timeout_s=3.0)
    try:
        hashes = client.hashes(TOKENS[:64])
        assert client.put(hashes, make_blocks(4, seed=7)).stored == 4
        assert client._local is not None
        path = client._local.path
        assert daemon.stop() == 0 and not os.path.exists(path)
        squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        squatter.bind(path)
        squatter.listen(8)
        squatter.settimeout(10.0)
        heard: list[bytes] = []

        def impostor() -> None:  # answers every hello with a made-up proof, records what follows
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = squatter.accept()
                    with conn:
                        conn.settimeout(3.0)
                        heard.append(read_frame(conn, 1 << 10) or b"")
                        send_frame(conn, b"K", os.urandom(32), struct.pack("<I", 1 << 20), daemon.address.encode())
                        with contextlib.suppress(OSError, ValueError):
                            heard.append(read_frame(conn, 1 << 12) or b"")

        thread = threading.Thread(target=impostor, daemon=True)
        thread.start()
        with pytest.raises(Unavailable):  # the local socket is not the daemon's; gRPC finds no daemon
            client.lookup(hashes)
        assert client._local is None  # no more local calls until the next hello
        squatter.close()
        thread.join(10)
        frames = [frame for frame in heard if frame]
        assert frames and all(TOKEN_A.encode() not in frame for frame in frames)
        assert all(frame.startswith(MAGIC) for frame in frames)  # it saw hellos, never a token
    finally:
        client.close()


def hold(path: str, key_id: bytes = b"", key: bytes = b"", token: str = "") -> socket.socket | None:
    """A raw connection the daemon admitted (with ``key``'s id and ``token``), or None if it
    answered busy."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(5.0)
    conn.connect(path)
    try:  # a busy daemon answers at once and closes: the hello may meet a closed socket
        send_frame(conn, MAGIC, key_id or os.urandom(16), os.urandom(16))
        if (read_frame(conn, 1 << 13) or b"E")[:1] == b"K":
            send_frame(conn, token.encode())
            if read_frame(conn, 1 << 10) == b"K":
                return conn
    except (BrokenPipeError, ConnectionResetError):
        pass
    conn.close()
    return None


def test_a_busy_socket_sends_the_call_over_gRPC_and_keeps_the_channel(pool_daemon: DaemonHandle) -> None:
    with PoolClient.connect(pool_daemon.address, SPEC, salt=b"s") as client:
        hashes = client.hashes(TOKENS[:64])
        assert client.put(hashes, make_blocks(4, seed=8)).stored == 4
        local = client._local
        assert local is not None
        mine = local._idle.pop()  # the channel's only connection, out of reach: a call needs a new one
        holders = [hold(local.path) for _ in range(MAX_LOCAL_CONNECTIONS - 1)]  # every other slot
        try:
            assert all(holders) and hold(local.path) is None  # full
            assert client.lookup(hashes) == 4  # refused "busy" locally, answered over gRPC
            assert client._local is local  # a passing refusal: the channel stays
            # a client that says hello now gets a channel with no connection yet, and uses it later
            late = PoolClient.connect(pool_daemon.address, SPEC, salt=b"s")
            assert late._local is not None and late._local._open == 0
            assert late.lookup(hashes) == 4
        finally:
            for holder in holders:
                if holder is not None:
                    holder.close()
            local._release(mine)
        time.sleep(0.2)  # the daemon's threads see the holders go
        assert client.lookup(hashes) == 4 and late.lookup(hashes) == 4
        assert late._local is not None and late._local._open == 1  # on the socket now
        late.close()


def test_one_tenant_cannot_take_every_local_connection(daemon_factory: Any, tmp_path: pathlib.Path) -> None:
    daemon = daemon_factory("--credentials", write_credentials(str(tmp_path)))
    with (
        PoolClient.connect(daemon.address, SPEC, salt=b"salt-a", token=TOKEN_A) as a,
        PoolClient.connect(daemon.address, SPEC, salt=b"salt-b", token=TOKEN_B) as b,
    ):
        assert a._local is not None and b._local is not None
        path, key_id, key = b._local.path, b._local._key_id, b._local._key
        held = [hold(path, key_id, key, TOKEN_B) for _ in range(MAX_TENANT_CONNECTIONS - 1)]  # B has one open
        try:
            assert all(held) and hold(path, key_id, key, TOKEN_B) is None  # B is at its share
            other = LocalChannel.open(path, a._local._key_id, a._local._key, TOKEN_A, a.node_id, 5.0)
            assert other._open == 1  # A still gets a connection
            other.close()
        finally:
            for conn in held:
                if conn is not None:
                    conn.close()


def test_a_trickled_hello_is_cut_off_at_its_deadline(pool_daemon: DaemonHandle) -> None:
    """One byte every 0.3 s: each read is quick, the whole hello (44 bytes, 13 s) is not; the
    daemon closes the connection before the last byte (its deadline is 2 s)."""
    with PoolClient.connect(pool_daemon.address, SPEC, salt=b"s") as client:
        assert client._local is not None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(client._local.path)
        closed_after = None
        with conn:
            for sent, byte in enumerate(hello()):
                try:
                    conn.send(bytes((byte,)))
                    time.sleep(0.3)
                    conn.setblocking(False)
                    ended = conn.recv(1) == b""
                except BlockingIOError:
                    ended = False
                except OSError:  # the daemon closed it: a reset or a broken pipe
                    ended = True
                conn.setblocking(True)
                if ended:
                    closed_after = sent
                    break
        assert closed_after is not None and closed_after < len(hello()) - 1


def test_sigterm_with_open_local_connections_exits(daemon_factory: Any) -> None:
    daemon = daemon_factory()
    client = PoolClient.connect(daemon.address, SPEC, salt=b"s")
    try:
        assert client._local is not None and client.lookup(client.hashes(TOKENS[:16])) == 0
        assert daemon.stop() == 0  # by SIGTERM, not killed after the stop timeout
        assert not os.path.exists(client._local.path)
    finally:
        client.close()


def test_the_async_client_calls_over_the_local_socket_too() -> None:
    metrics_address = f"127.0.0.1:{free_port()}"
    daemon = start_daemon("--metrics-listen", metrics_address)

    async def run() -> None:
        async with await AsyncPoolClient.connect(daemon.address, SPEC, salt=b"s") as client:
            assert client._local is not None
            hashes, blocks = client.hashes(TOKENS), make_blocks(8, seed=9)
            assert (await client.put(hashes, blocks)).stored == 8
            assert await client.lookup(hashes) == 8
            assert (await client.get(hashes)).tobytes() == blocks.tobytes()
            big = [os.urandom(16) for _ in range(20_000)]  # larger than the socket buffer
            assert await client.lookup(big) == 0
        async with await AsyncPoolClient.connect(daemon.address, SPEC, salt=b"s", local_calls=False) as client:
            assert client._local is None and await client.lookup(hashes) == 8

    try:
        asyncio.run(run())
        assert local_count(metrics_address, "Lookup") == 2 and local_count(metrics_address, "Lease") == 1
        assert local_count(metrics_address, "Lookup", service="pool") == 1  # the gRPC-only client's
    finally:
        daemon.cleanup()


# -- a stranger on the socket ------------------------------------------------------------------
@pytest.fixture(scope="module")
def victim() -> Any:
    daemon = start_daemon(capacity="32MiB")
    client = PoolClient.connect(daemon.address, SPEC, salt=b"victim")
    hashes, blocks = client.hashes(TOKENS[:64]), make_blocks(4, seed=5)
    assert client.put(hashes, blocks).stored == 4 and client._local is not None
    yield daemon, client, hashes, blocks
    client.close()
    daemon.cleanup()


def exchange(path: str, chunks: list[bytes]) -> bytes:
    """Send ``chunks`` on a fresh connection; everything the daemon answers before it closes
    or goes quiet for 2 s."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(2.0)
    answer = b""
    try:
        conn.connect(path)
        for chunk in chunks:
            conn.sendall(chunk)
        conn.shutdown(socket.SHUT_WR)
        while True:
            got = conn.recv(1 << 16)
            if not got:
                break
            answer += got
    except (TimeoutError, BrokenPipeError, ConnectionResetError):
        pass
    finally:
        conn.close()
    return answer


def hello() -> bytes:
    body = MAGIC + os.urandom(32)  # any key id and nonce: the daemon proves itself, then wants a token
    return struct.pack("<I", len(body)) + body + struct.pack("<I", 0)  # and an empty token


def frame(*parts: bytes) -> bytes:
    body = b"".join(parts)
    return struct.pack("<I", len(body)) + body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    with_hello=st.booleans(),
    method=st.sampled_from(["Lookup", "Lease", "PutStart", "Remove", "Events", "Nope", ""]),
    raw=st.binary(max_size=512),
    garbage=st.binary(max_size=64),
)
def test_a_strangers_bytes_get_typed_answers_or_a_closed_connection(
    victim: Any, with_hello: bool, method: str, raw: bytes, garbage: bytes
) -> None:
    daemon, client, _, _ = victim
    assert client._local is not None
    chunks = [hello()] if with_hello else []
    if method:
        head, _ = pack_call(method, b"")
        chunks.append(frame(head, raw))
    chunks.append(garbage)
    answer = exchange(client._local.path, chunks)
    while answer:  # every answer is a whole frame: a proof, OK / a typed error, or a refusal
        (size,) = struct.unpack_from("<I", answer)
        assert answer[4 : 4 + 1] in (b"K", b"E") and 1 <= size <= len(answer) - 4
        answer = answer[4 + size :]
    assert daemon.proc.poll() is None


def test_an_oversized_frame_is_refused_before_it_is_read(victim: Any) -> None:
    client = victim[1]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(5.0)
    conn.connect(client._local.path)
    conn.sendall(hello())
    assert read_frame(conn, 1 << 13) is not None  # the proof
    assert read_frame(conn, 1 << 10) == b"K"  # admitted (no credentials)
    conn.sendall(struct.pack("<I", 1 << 31))  # announces 2 GiB, sends none of it
    assert conn.recv(16) == b""  # closed at once
    conn.close()


def test_after_the_strangers_the_victim_reads_its_blocks(victim: Any) -> None:
    daemon, client, hashes, blocks = victim
    assert client.get(hashes).tobytes() == blocks.tobytes()
    assert client._local is not None  # still on the socket
    assert "Traceback" not in daemon.stderr()
