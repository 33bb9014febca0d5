"""One shared-memory arena per node: a file in /dev/shm, mapped by the daemon and by
every same-host client, so block bytes move with one memcpy and never through gRPC.

The daemon creates it (``SharedArena.create``) and removes the file on close; clients
map the same file by path (``SharedArena.attach``). Pages are touched lazily, so a
large arena costs memory only as blocks are written.

Or, with the arena hand-off (``kvpool.daemon.arena_handoff``), it is an anonymous memfd
(``create_memfd``: no path any process can open, its size sealed so no holder can shrink
it under the daemon) whose descriptors reach only admitted clients (``from_fd``): a
read-only one (``read_only_fd``: a mapping of it cannot be made writable) or the
read-write one.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import pathlib
import uuid

import numpy as np

from kvpool.core.errors import InvalidArgument, StorageFault, Unavailable


class SharedArena:
    """A mapped shared-memory file, exposed as one flat uint8 numpy array (``view``)."""

    def __init__(self, path: str, capacity_bytes: int, owner: bool, fd: int, mapping: mmap.mmap) -> None:
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.owner = owner
        self._fd = fd
        self._mmap = mapping
        self.view = np.frombuffer(mapping, dtype=np.uint8)

    @classmethod
    def create(cls, directory: str, capacity_bytes: int, name_hint: str = "kvpool") -> SharedArena:
        """Create a new arena file of ``capacity_bytes`` under ``directory`` (normally /dev/shm)."""
        if capacity_bytes <= 0:
            raise InvalidArgument("arena capacity_bytes must be positive")
        folder = pathlib.Path(directory)
        if not folder.is_dir():
            raise StorageFault(f"arena directory {directory} does not exist", hint="use --arena-dir /dev/shm")
        path = str(folder / f"{name_hint}-{os.getpid()}-{uuid.uuid4().hex[:8]}.arena")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise StorageFault(f"cannot create arena file {path}: {exc}", hint="check --arena-dir is writable") from exc
        try:
            os.ftruncate(fd, capacity_bytes)
            mapping = mmap.mmap(fd, capacity_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise StorageFault(
                f"cannot map a {capacity_bytes}-byte arena at {path}: {exc}",
                hint="lower --capacity-bytes or enlarge /dev/shm",
            ) from exc
        return cls(path, capacity_bytes, True, fd, mapping)

    @classmethod
    def create_memfd(cls, capacity_bytes: int, name_hint: str = "kvpool") -> SharedArena:
        """A new arena in an anonymous memfd (no file name to open), sealed against shrinking
        and growing: a client that holds its descriptor cannot make the daemon's pages vanish
        (SIGBUS) by truncating it."""
        try:
            fd = os.memfd_create(f"{name_hint}-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise StorageFault(f"cannot create a memfd arena: {exc}", hint="use --arena-handoff file") from exc
        try:
            os.ftruncate(fd, capacity_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mapping = mmap.mmap(fd, capacity_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            raise StorageFault(f"cannot map a {capacity_bytes}-byte memfd arena: {exc}") from exc
        return cls("", capacity_bytes, True, fd, mapping)

    @classmethod
    def from_fd(cls, fd: int, capacity_bytes: int, writable: bool, name: str = "") -> SharedArena:
        """Map an arena descriptor received from the daemon; takes ownership of ``fd``.
        ``writable`` False maps it read-only (the view is a read-only array). ``name``: where
        it came from (its ``path``, never unlinked: the client does not own it)."""
        try:
            size = os.fstat(fd).st_size
            if size < capacity_bytes:
                raise Unavailable(f"the arena handed over is {size} bytes, expected {capacity_bytes}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mapping = mmap.mmap(fd, capacity_bytes, mmap.MAP_SHARED, prot)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, capacity_bytes, False, fd, mapping)

    def read_only_fd(self) -> int:
        """A new descriptor of this arena opened O_RDONLY (through /proc/self/fd): whoever
        receives it can map it only read-only (mmap PROT_WRITE of it is EACCES)."""
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

    @property
    def fd(self) -> int:
        return self._fd

    @property
    def writable(self) -> bool:
        return bool(self.view.flags.writeable)

    @classmethod
    def attach(cls, path: str, capacity_bytes: int) -> SharedArena:
        """Map an existing arena (a same-host client)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise Unavailable(
                f"cannot open the pool's arena {path}: {exc}",
                hint="the client must run on the daemon's host, as a user that can read it",
            ) from exc
        try:
            size = os.fstat(fd).st_size
            if size < capacity_bytes:
                raise Unavailable(f"arena {path} is {size} bytes, expected {capacity_bytes}")
            mapping = mmap.mmap(fd, capacity_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, capacity_bytes, False, fd, mapping)

    @staticmethod
    def reap_stale(directory: str, name_hint: str = "kvpool") -> list[str]:
        """Remove arena files left by daemons that died without cleaning up (SIGKILL, OOM).

        A file is stale when the pid in its name is no longer alive; each would otherwise
        pin its size of shared memory until reboot.
        """
        removed: list[str] = []
        for path in pathlib.Path(directory).glob(f"{name_hint}-*-*.arena"):
            parts = path.name.split("-")
            if len(parts) < 3 or not parts[1].isdigit():
                continue
            pid = int(parts[1])
            if pid == os.getpid() or _pid_alive(pid):
                continue
            try:
                path.unlink()
                removed.append(str(path))
            except OSError:
                pass  # another user's file, or already gone
        return removed

    def region(self, offset: int, length: int) -> np.ndarray:
        """A uint8 view of [offset, offset + length) with bounds checked."""
        if offset < 0 or length < 0 or offset + length > self.capacity_bytes:
            raise InvalidArgument(f"arena region [{offset}, {offset + length}) is outside 0..{self.capacity_bytes}")
        return self.view[offset : offset + length]

    def close(self) -> None:
        """Unmap; the owner also removes the file. Views handed out must be dropped first."""
        if self._fd < 0:
            return
        self.view = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass  # a live numpy view still exports the buffer; the mapping dies with it
        os.close(self._fd)
        self._fd = -1
        if self.owner and self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True
