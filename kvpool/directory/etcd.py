"""etcd v3 through the ``aetcd`` client (gRPC), behind a small synchronous facade.

``EtcdSession`` owns one ``aetcd.Client`` and the one asyncio loop it runs on, in one
thread named ``kvpool-etcd`` that ``close`` joins. Callers on other threads use the
blocking helpers (``get``, ``get_prefix``, ``put``); the long-lived roles built on it —
leader election (``election.py``), node membership and the directory's watch of it
(``membership.py``) — run as tasks on that loop, so one process has one etcd connection
whatever it does with etcd.

Every failure to reach etcd (refused, timed out, cut mid-call) is ``Unavailable`` naming
the endpoints, so a caller can keep serving and say what it cannot do. With several
endpoints the session moves to the next one when a call fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions

from kvpool.core.errors import InvalidArgument, Unavailable

log = logging.getLogger("kvpool.etcd")

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 2.0
# what a failed or cut call to etcd raises inside aetcd / grpc.aio
ETCD_ERRORS: tuple[type[BaseException], ...] = (aetcd.exceptions.ClientError, asyncio.TimeoutError, OSError)


def leader_key(cluster: str) -> bytes:
    return f"/kvpool/{cluster}/directory/leader".encode()


def nodes_prefix(cluster: str) -> bytes:
    return f"/kvpool/{cluster}/nodes/".encode()


def _host_port(endpoint: str) -> tuple[str, int]:
    text = endpoint.removeprefix("http://").removeprefix("https://").rstrip("/")
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgument(f"etcd endpoint {endpoint!r} is not HOST:PORT", hint="e.g. --etcd 127.0.0.1:2379")
    return host, int(port)


class EtcdSession:
    """One etcd client on its own loop thread. ``start`` before use, ``close`` to join."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not endpoints:
            raise InvalidArgument("no etcd endpoint given", hint="e.g. --etcd 127.0.0.1:2379")
        self.endpoints = [f"{h}:{p}" for h, p in map(_host_port, endpoints)]
        self.timeout_s = timeout_s
        self._preferred = 0
        self._client: aetcd.Client | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kvpool-etcd", daemon=True)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    # -- the loop --------------------------------------------------------------------------
    def start(self) -> EtcdSession:
        self._thread.start()
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        # close: cancel what is left, close the client, then the loop
        pending = [t for t in self._tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        if self._client is not None:
            with contextlib.suppress(*ETCD_ERRORS):
                self._loop.run_until_complete(self._client.close())
        self._loop.close()

    def on_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def spawn(self, name: str, coro: Coroutine[Any, Any, None], on_crash: Callable[[BaseException], None]) -> None:
        """Run a long-lived role on the loop; ``on_crash`` hears an exception that escapes it
        (a bug: the roles catch etcd's failures themselves), so its owner can stop loudly."""

        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                log.critical("etcd task %r crashed: %s", name, exc, exc_info=True)
                on_crash(exc)

        def create() -> None:
            task = self._loop.create_task(guarded(), name=f"kvpool-etcd-{name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._loop.call_soon_threadsafe(create)

    def run(self, make: Callable[[aetcd.Client], Awaitable[T]], timeout_s: float | None = None) -> T:
        """Run one etcd call from a thread other than the loop's; ``Unavailable`` on failure."""
        if self.on_loop():
            raise RuntimeError("EtcdSession.run called on its own loop: await call() instead")
        if self._closed:
            raise Unavailable("the etcd session is closed")
        budget_s = timeout_s or self.timeout_s
        future = asyncio.run_coroutine_threadsafe(self.call(make, budget_s), self._loop)
        try:
            return future.result(budget_s + 1.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise self.unavailable(f"no answer in {budget_s} s") from None

    async def call(self, make: Callable[[aetcd.Client], Awaitable[T]], timeout_s: float | None = None) -> T:
        """One etcd call on the loop, bounded by ``timeout_s``; a failure moves the session to
        the next endpoint and is ``Unavailable``."""
        client: aetcd.Client | None = None
        try:
            client = await self._connected()
            return await asyncio.wait_for(make(client), timeout_s or self.timeout_s)
        except ETCD_ERRORS as exc:
            log.debug("etcd call failed: %r", exc)
            await self._drop_client(client)
            raise self.unavailable(str(exc) or type(exc).__name__) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our owner cancels us: stop
            # grpc.aio cancels the calls in flight on a channel another task closed after its
            # own call failed: a failed call here too, not a reason to stop
            raise self.unavailable("the connection was closed under this call") from None

    async def revoke(self, lease_id: int) -> None:
        """Revoke a lease (its keys go with it); one that already expired is not an error."""

        async def revoke(client: aetcd.Client) -> None:
            try:
                await client.revoke_lease(lease_id)
            except aetcd.exceptions.ClientError as exc:
                if "lease not found" not in str(exc):
                    raise

        await self.call(revoke)

    def unavailable(self, why: str) -> Unavailable:
        return Unavailable(
            f"etcd is not reachable at {','.join(self.endpoints)} ({why})",
            hint="start etcd or check --etcd; the cluster cannot elect or notice node deaths meanwhile",
        )

    async def _connected(self) -> aetcd.Client:
        if self._client is None:
            host, port = _host_port(self.endpoints[self._preferred])
            client = aetcd.Client(host=host, port=port, timeout=self.timeout_s)  # type: ignore[arg-type]
            try:
                await asyncio.wait_for(client.connect(), self.timeout_s)
            except ETCD_ERRORS:
                self._preferred = (self._preferred + 1) % len(self.endpoints)
                with contextlib.suppress(*ETCD_ERRORS):
                    await asyncio.wait_for(client.close(), self.timeout_s)
                raise
            self._client = client
        return self._client

    async def _drop_client(self, failed: aetcd.Client | None) -> None:
        """Close the client a call failed on and move to the next endpoint, unless another
        task already did (then the current client is a new one: keep it)."""
        if failed is None or failed is not self._client:
            return
        client, self._client = self._client, None
        self._preferred = (self._preferred + 1) % len(self.endpoints)
        if client is not None:
            with contextlib.suppress(*ETCD_ERRORS):
                await asyncio.wait_for(client.close(), self.timeout_s)

    def close(self) -> None:
        """Cancel the roles (their ``finally`` blocks run: a leader resigns, a node leaves),
        close the client and join the loop thread."""
        if self._closed:
            return
        self._closed = True
        if not self._thread.is_alive():
            self._loop.close()
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.timeout_s * 3 + 5.0)

    # -- blocking helpers --------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        reply = self.run(lambda c: c.get(key))
        return None if reply is None else bytes(reply.value)

    def get_prefix(self, prefix: bytes) -> dict[bytes, bytes]:
        reply = self.run(lambda c: c.get_prefix(prefix))
        return {bytes(kv.key): bytes(kv.value) for kv in reply}

    def put(self, key: bytes, value: bytes) -> None:
        self.run(lambda c: c.put(key, value))

    def delete(self, key: bytes) -> None:
        self.run(lambda c: c.delete(key))


async def wait_for_change(client: aetcd.Client, key: bytes, start_revision: int, timeout_s: float) -> bool:
    """Wait (a watch, not a poll) until ``key`` changes at or after ``start_revision``; False
    when ``timeout_s`` passed first, so the caller re-reads (a watch on a cut connection may
    never say so)."""
    watch = await client.watch(key, start_revision=start_revision)
    try:
        async with asyncio.timeout(timeout_s):
            async for _event in watch:
                return True
    except TimeoutError:
        return False
    finally:
        with contextlib.suppress(*ETCD_ERRORS):
            await asyncio.wait_for(watch.cancel(), 1.0)
    return False


def find_leader(etcd: EtcdSession, cluster: str) -> str:
    value = etcd.get(leader_key(cluster))
    if not value:
        raise Unavailable(
            f"no directory leader is registered in etcd for cluster {cluster!r}",
            hint="start 'kvpool directory --etcd ...'",
        )
    return value.decode()
