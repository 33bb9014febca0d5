"""The arena as a client maps it, against a real daemon (issue 10, item 3).

- A client's mapping of the arena is read-only except, during a put, the pages of that
  put's slots (``/proc/self/maps`` of the client, checked during and after the put), in
  both hand-off modes (``fd``: a memfd passed over the 0600 socket; ``file``: by path).
- A second, real process that holds the write descriptor (tenant B, which started a put of
  its own to get it, or any same-uid process opening the arena file) scribbles over the
  whole arena after tenant A's blocks were committed: A's reads, through the arena and
  through the TCP data plane, get 0 wrong bytes (misses, dropped after the node
  re-verified them), and A's next put stores fresh bytes that read back exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from conftest import DaemonHandle, free_port
from test_auth import NS_A, SPEC, TOKEN_A, TOKEN_B, TOKENS, make_blocks, wait_for_port, write_credentials

import kvpool.client.pool_client as pool_client_module
from kvpool import PoolClient
from kvpool.core.arena_segments import SegmentedMapping

SCRIBBLER = textwrap.dedent(
    """
    import json, mmap, os, sys
    from kvpool import KVSpec, PoolClient
    from kvpool.core.errors import PermissionDenied
    from kvpool.transport.arena_handoff import receive_arena_segment
    address, token, arena_path, capacity, salt = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    spec = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
    fds, refused = [], 0
    if arena_path:  # a node without the hand-off: any process of the uid opens the file
        fds.append(os.open(arena_path, os.O_RDWR))
    else:  # a client starts a put of its own, so the node hands it write descriptors
        b = PoolClient.connect(address, spec, salt=salt.encode(), token=token)
        start = b._rpc("PutStart", b._hashes_request(b.hashes(range(10**6, 10**6 + 16))))
        assert start.put_id != 0
        for seg in range(b._arena.num_segments):  # ask for every segment of the arena
            try:
                fds.append(receive_arena_segment(b._arena.path, "w", start.put_id, seg, token)[0])
            except PermissionDenied:
                refused += 1
    scribbled = 0
    for fd in fds:
        size = os.fstat(fd).st_size
        view = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        view[:] = b"\\xab" * size  # every byte it was handed
        view.close()
        scribbled += size
    print(json.dumps({"scribbled": scribbled, "refused": refused}))
    """
)


def arena_maps(client: PoolClient) -> list[tuple[int, str]]:
    """(bytes, perms) of each mapping of the client's arena in this process (a per-tenant
    arena's segments: the memfds named ``kvpool-arena-N``). A mapping tagged with a memory
    protection key (the keyed write mapping of ``PoolClient.put``, kvpool.core.pkeys) counts
    as ``---s``: every thread is denied it but the one copying a put, during its copy."""
    assert client._arena is not None
    segmented = isinstance(client._arena, SegmentedMapping)
    inode = -1 if segmented else os.fstat(client._arena.fd).st_ino
    out: list[list[Any]] = []
    ours = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            parts = line.split()
            if parts and "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                ours = len(parts) >= 6 and (int(parts[4]) == inode or (segmented and "memfd:kvpool-arena-" in parts[5]))
                if ours:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    out.append([hi - lo, parts[1]])
            elif ours and parts[0] == "ProtectionKey:" and int(parts[1]) != 0:
                out[-1][1] = "---s"
    return [(size, perms) for size, perms in out]


def start(daemon_factory: Any, workdir: str, mode: str, *extra: str) -> tuple[DaemonHandle, str]:
    """A daemon with credentials and the arena handed out by ``mode`` ('fd' or 'file')."""
    args = ["--credentials", write_credentials(workdir), "--arena-handoff", mode, *extra]
    handle: DaemonHandle = daemon_factory(*args)
    return handle, mode


@pytest.fixture
def workdir(tmp_path: Any) -> str:
    return str(tmp_path)


@pytest.mark.parametrize("mode", ["fd", "file"])
def test_a_client_maps_the_arena_read_only_outside_its_puts(
    daemon_factory: Any, workdir: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon, _ = start(daemon_factory, workdir, mode)
    with PoolClient.connect(daemon.address, SPEC, salt=b"salt-a", token=TOKEN_A) as a:
        maps = arena_maps(a)
        assert all("w" not in perms for _, perms in maps)  # read-only from Hello on
        assert (maps == []) == (mode == "fd")  # per tenant: no segment mapped before a lease or put
        during: list[list[tuple[int, str]]] = []
        real_write_rows = pool_client_module.write_rows

        def spy(window: Any, rows: Any, indices: Any, offsets: Any) -> list[int]:
            during.append(arena_maps(a))
            return real_write_rows(window, rows, indices, offsets)

        monkeypatch.setattr(pool_client_module, "write_rows", spy)
        hashes = a.hashes(TOKENS)
        blocks = make_blocks(4, seed=21)
        assert a.put(hashes, blocks).stored == 4
        writable = sum(size for size, perms in during[0] if "w" in perms)
        keyed = getattr(a._arena, "_keyed", None) is not None  # a per-tenant arena maps a window per put
        if keyed:  # this thread holds the key open only inside write_rows' copy: nothing is open here
            assert writable == 0
        else:
            assert 4 * SPEC.block_bytes <= writable <= 4 * SPEC.block_bytes + 8 * 4096  # its slots' pages only
        assert writable < a._arena.capacity_bytes
        assert all("w" not in perms for _, perms in arena_maps(a))  # gone when the put is in
        assert not a._arena.writable
        with pytest.raises(ValueError):
            a.arena[0] = 1
        np.testing.assert_array_equal(a.get(hashes), blocks)
        assert a.put(a.hashes([t + 5 for t in TOKENS]), make_blocks(4, seed=22)).stored == 4  # again
        assert arena_maps(a) and all("w" not in perms for _, perms in arena_maps(a))


@pytest.mark.parametrize("mode", ["fd", "file"])
def test_a_post_commit_overwrite_by_another_process_is_never_served(
    daemon_factory: Any, workdir: str, mode: str
) -> None:
    from kvpool.client.tickets import StaticTickets
    from kvpool.transport.base import ReadItem
    from kvpool.transport.tcp import TcpTransport

    data_address = f"127.0.0.1:{free_port()}"
    daemon, _ = start(daemon_factory, workdir, mode, "--data-listen", data_address)
    wait_for_port(data_address)
    with PoolClient.connect(daemon.address, SPEC, salt=b"salt-a", token=TOKEN_A) as a:
        hashes = a.hashes(TOKENS)
        blocks = make_blocks(4, seed=23)
        assert a.put(hashes, blocks).stored == 4
        np.testing.assert_array_equal(a.get(hashes), blocks)
        assert a._arena is not None
        arena_path = a._arena.path if mode == "file" else ""

        def scribble(token: str, salt: str) -> dict[str, int]:
            assert a._arena is not None
            argv = [sys.executable, "-c", SCRIBBLER, daemon.address, token, arena_path, str(a._arena.capacity_bytes)]
            done = subprocess.run([*argv, salt], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            result: dict[str, int] = json.loads(done.stdout)
            return result

        if mode == "fd":  # per-tenant arena: tenant B is handed none of A's segments
            by_b = scribble(TOKEN_B, "salt-b")
            assert by_b["refused"] >= 1 and by_b["scribbled"] < a._arena.capacity_bytes
            np.testing.assert_array_equal(a.get(hashes), blocks)  # A's bytes untouched, all served
            # the checksums still catch a writer of A's own tenant (another process with A's token)
            assert scribble(TOKEN_A, "salt-a")["scribbled"] > 0
        else:
            assert scribble(TOKEN_B, "salt-b")["scribbled"] == a._arena.capacity_bytes  # the file: all of it
        lease = a._rpc("Lease", a._hashes_request(hashes))
        a._arena.ensure(lease.offsets, lease.segment_generations)
        assert all((a.arena[off : off + SPEC.block_bytes] == 0xAB).all() for off in lease.offsets)  # really changed
        # the data plane serves nothing wrong: the reader checks the committed checksums
        transport = TcpTransport(timeout_s=5.0)
        transport.use_tickets(StaticTickets(a.data_ticket))
        dst = np.zeros((4, SPEC.block_bytes), dtype=np.uint8)
        try:
            result = transport.read(data_address, NS_A, [ReadItem(h) for h in hashes], list(dst))
        finally:
            transport.close()
        assert result.ok == 0
        # nor does the arena: each read is a miss, and the node drops what it re-verified as bad
        expected = blocks.reshape(4, -1).view(np.uint8)
        wrong_bytes_served = 0
        for i in range(4):
            got = a.get(hashes[i:])
            wrong_bytes_served += sum(int((row.reshape(-1).view(np.uint8) != expected[i + j]).sum())
                                      for j, row in enumerate(got))  # fmt: skip
            assert len(got) == 0
        assert wrong_bytes_served == 0
        assert a.lookup(hashes) == 0  # dropped: the next put stores fresh bytes
        assert a.stats()["checksum_failures"] >= 4
        assert a.put(hashes, blocks).stored == 4
        np.testing.assert_array_equal(a.get(hashes), blocks)


PROC_PROBE = textwrap.dedent(
    """
    import json, os, sys
    pid = sys.argv[1]
    out = {"arena_opened": False, "mem_opened": False, "errors": []}
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                if "kvpool-arena" in os.readlink(f"/proc/{pid}/fd/{name}"):
                    os.close(os.open(f"/proc/{pid}/fd/{name}", os.O_RDWR))
                    out["arena_opened"] = True
            except OSError as exc:
                out["errors"].append(type(exc).__name__)
    except OSError as exc:
        out["errors"].append(type(exc).__name__)
    try:
        open(f"/proc/{pid}/mem", "rb").close()
        out["mem_opened"] = True
    except OSError as exc:
        out["errors"].append(type(exc).__name__)
    print(json.dumps(out))
    """
)


def as_unprivileged() -> list[str]:
    """The argv prefix that runs a command as a plain user without capabilities: this test
    suite runs as root here, and root's CAP_SYS_PTRACE passes every check being tested."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot run the daemon and the probe as a plain user")
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def probe_proc(pid: int) -> dict[str, Any]:
    """What another process of the daemon's uid gets from /proc/PID."""
    import json

    done = subprocess.run(
        [*as_unprivileged(), sys.executable, "-c", PROC_PROBE, str(pid)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@contextlib.contextmanager
def open_workdir() -> Iterator[str]:
    """A directory every uid can reach (not under pytest's 0700 tmp root) for the arena,
    its socket and a readable credentials file."""
    workdir = tempfile.mkdtemp(prefix="kvpool-uid-", dir="/tmp")
    os.chmod(workdir, 0o777)
    try:
        yield workdir
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def serve(workdir: str, *args: str, prefix: Sequence[str] = ()) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``kvpool serve`` with credentials and its arena in ``workdir``, run under ``prefix``."""
    creds = write_credentials(workdir)
    os.chmod(creds, 0o644)
    address = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "kvpool.cli.main", "serve", "--listen", address, "--capacity-bytes", "16MiB"]
    argv += ["--arena-dir", workdir, "--credentials", creds, *args]
    proc = subprocess.Popen([*prefix, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_port(address, timeout_s=30)
        yield proc, address
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err.decode(errors="replace")


@pytest.mark.parametrize("protect", ["auto", "off"])
def test_a_daemon_with_credentials_keeps_same_uid_processes_out_of_its_proc_files(protect: str) -> None:
    """With credentials the daemon is non-dumpable (``--protect-process auto``): a process of
    its uid cannot open its arena through /proc/PID/fd nor read /proc/PID/mem. Left dumpable
    (``off``) the same probe gets both: that is what the protection stops."""
    with open_workdir() as workdir, serve(workdir, "--protect-process", protect, prefix=as_unprivileged()) as (proc, _):
        got = probe_proc(proc.pid)
    if protect == "off":
        assert got["arena_opened"] and got["mem_opened"], got
    else:
        assert not got["arena_opened"] and not got["mem_opened"] and "PermissionError" in got["errors"], got


READER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from kvpool import KVSpec, PoolClient
    address, token, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    spec = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
    raw = np.random.default_rng(seed).integers(0, 2**16, size=(4, *spec.block_shape), dtype=np.uint16)
    try:
        with PoolClient.connect(address, spec, salt=b"salt-a", token=token) as a:
            got = a.get(a.hashes(list(range(7000, 7000 + 64))))
            print("read", len(got), got.tobytes() == raw.view(np.float16).tobytes())
    except Exception as exc:
        print("refused", type(exc).__name__)
    """
)


def test_clients_of_another_uid_get_the_arena_through_a_wider_socket_mode_with_a_token() -> None:
    """The recommended deployment: the daemon under its own uid, each tenant's engines under
    theirs. ``--arena-socket-mode 666`` lets them connect; the token still decides."""
    prefix = as_unprivileged()
    if not prefix:
        pytest.skip("needs root to run the reader as another uid")
    with open_workdir() as workdir, serve(workdir, "--arena-socket-mode", "666") as (_, address):
        with PoolClient.connect(address, SPEC, salt=b"salt-a", token=TOKEN_A) as a:
            assert a.put(a.hashes(TOKENS), make_blocks(4, seed=25)).stored == 4
            socket_path = a._arena.path if a._arena is not None else ""
        assert oct(os.stat(socket_path).st_mode & 0o777) == "0o666"

        def read(token: str) -> str:
            done = subprocess.run(
                [*prefix, sys.executable, "-c", READER, address, token, "25"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            return done.stdout.strip()

        assert read(TOKEN_A) == "read 4 True"  # another uid, the tenant's token: its bytes, exactly
        assert read("kvp_wrong").startswith("refused")
