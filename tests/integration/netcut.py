"""A TCP proxy on 127.0.0.1 whose link can be cut, to partition one process from another
(a directory from etcd) without touching either.

``cut()`` is a black hole, the hard kind of partition: connections stay open but nothing
is forwarded either way, and new connections are accepted and then ignored, so the
cut-off side sees timeouts rather than a clean error. ``restore()`` forwards again (new
connections only: the ones that saw the cut are closed). Every thread it starts is joined
by ``close()``.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading

MAX_CONNECTIONS = 64


class CuttableProxy:
    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._cut = threading.Event()
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept, name="netcut-accept", daemon=True)
        self._accepter.start()

    def cut(self) -> None:
        self._cut.set()

    def restore(self) -> None:
        """Forward again; close the connections that lived through the cut (their peers
        must reconnect, as after a real partition whose TCP state timed out)."""
        with self._lock:
            socks, self._socks = self._socks, []
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._cut.clear()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]
                if len(self._threads) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                thread = threading.Thread(target=self._pump, args=(conn,), name="netcut-pump", daemon=True)
                self._threads.append(thread)
            thread.start()

    def _pump(self, conn: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            if not self._cut.is_set():
                upstream = socket.create_connection(self._upstream, timeout=2.0)
            with self._lock:
                self._socks += [s for s in (conn, upstream) if s is not None]
            with selectors.DefaultSelector() as sel:
                sel.register(conn, selectors.EVENT_READ, upstream)
                if upstream is not None:
                    sel.register(upstream, selectors.EVENT_READ, conn)
                while not self._closing.is_set():
                    for key, _ in sel.select(0.1):
                        data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                        if not data:
                            return
                        if not self._cut.is_set() and key.data is not None:
                            key.data.sendall(data)  # cut: read and drop (a black hole)
        except OSError:
            return
        finally:
            for sock in (conn, upstream):
                if sock is not None:
                    sock.close()

    def close(self) -> None:
        self._closing.set()
        self._listener.close()
        self._accepter.join(5)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(5)

    def __enter__(self) -> CuttableProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
