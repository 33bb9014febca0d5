"""Finding and calling the directory leader, for nodes and clients.

The leader is found through etcd (the election key) when etcd endpoints are given, else
by asking each configured directory address. A call that reaches a standby (NOT_LEADER)
or a dead leader (UNAVAILABLE) rediscovers the leader and is retried once, so a failover
costs the caller one extra round trip, not an error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from kvpool.core.errors import InvalidArgument, NotLeader, TenantBusy, Unavailable
from kvpool.core.retry import RetryPolicy, retry_call
from kvpool.directory.etcd import EtcdSession, find_leader
from kvpool.proto import directory_pb2, directory_pb2_grpc
from kvpool.rpc.auth import call_metadata, make_channel
from kvpool.rpc.codec import channel_options
from kvpool.rpc.errors import TLS_HINT, TlsFailed, from_rpc_error

log = logging.getLogger("kvpool.directory.link")

T = TypeVar("T")
MAX_MESSAGE_BYTES = 64 << 20
#: a standby's NOT_LEADER or a dead leader's UNAVAILABLE: find the leader and call once more
FAILOVER_REDIRECT = RetryPolicy(first_delay_ms=0, max_delay_ms=0, max_attempts=2)
#: the directory's TENANT_BUSY (this tenant past its share): 3 retries after 10, 20, 40 ms, as
#: PoolClient does with a node's; then the caller gets it (a read treats it as a miss)
BUSY_RETRY = RetryPolicy(first_delay_ms=10, max_delay_ms=40, max_attempts=4)


class DirectoryLink:
    def __init__(
        self,
        addresses: Sequence[str] = (),
        etcd: EtcdSession | None = None,
        cluster: str = "default",
        timeout_s: float = 5.0,
        token: str = "",
        owns_etcd: bool = False,
        root_certs: bytes | None = None,
    ) -> None:
        """``token``: sent with every call (a tenant's for a client, the cluster token for
        a node) to a directory with credentials. ``owns_etcd``: ``close`` closes ``etcd``
        too (a client's own session; a node shares its session with its membership).
        ``root_certs``: PEM CA of a TLS directory (every instance: a failover dials another);
        None dials in plaintext."""
        if not addresses and etcd is None:
            raise InvalidArgument("no directory address and no etcd endpoint", hint="pass --directory or --etcd")
        self.addresses = list(addresses)
        self.etcd = etcd
        self._owns_etcd = owns_etcd
        self.cluster = cluster
        self.timeout_s = timeout_s
        self._metadata = call_metadata(token)
        self._root_certs = root_certs
        self._lock = threading.Lock()
        self._leader = ""
        self._channel: grpc.Channel | None = None
        self._stub: directory_pb2_grpc.DirectoryStub | None = None

    @property
    def leader(self) -> str:
        return self._leader

    def _stub_for(self, address: str) -> tuple[grpc.Channel, directory_pb2_grpc.DirectoryStub]:
        channel: grpc.Channel = make_channel(address, channel_options(MAX_MESSAGE_BYTES), self._root_certs)
        return channel, directory_pb2_grpc.DirectoryStub(channel)

    def discover(self) -> str:
        """Find the leader now (etcd first, then each configured address)."""
        errors: list[str] = []
        tls_failures = 0
        if self.etcd is not None:
            try:
                return self._use(find_leader(self.etcd, self.cluster))
            except Unavailable as err:
                errors.append(str(err))
        for address in self.addresses:
            channel, stub = self._stub_for(address)
            try:
                reply = stub.Leader(
                    directory_pb2.LeaderRequest(), timeout=min(self.timeout_s, 2.0), metadata=self._metadata
                )
            except grpc.RpcError as exc:
                failure = from_rpc_error(exc, address)
                tls_failures += isinstance(failure, TlsFailed)
                errors.append(f"{address}: {failure}")
                channel.close()
                continue
            channel.close()
            if reply.is_leader:
                return self._use(address)
            if reply.leader:
                return self._use(reply.leader)
        if tls_failures and tls_failures == len(errors):  # every directory refused our TLS: configuration
            raise TlsFailed(f"no directory accepted the TLS handshake ({'; '.join(errors)})", hint=TLS_HINT)
        raise Unavailable(
            f"no directory leader found ({'; '.join(errors) or 'no candidates'})",
            hint="start 'kvpool directory' and check --directory / --etcd"
            + ("; a directory that serves TLS needs its CA (--directory-tls-ca)" if self._root_certs is None else ""),
        )

    def _use(self, address: str) -> str:
        with self._lock:
            if address != self._leader or self._stub is None:
                if self._channel is not None:
                    self._channel.close()
                self._channel, self._stub = self._stub_for(address)
                self._leader = address
        return address

    def call(self, name: str, request: Any, timeout_s: float | None = None) -> Any:
        """Call ``Directory.<name>`` on the leader, rediscovering it once on failover
        (``FAILOVER_REDIRECT``)."""

        def once() -> Any:
            if self._stub is None:
                self.discover()
            stub, leader = self._stub, self._leader
            assert stub is not None
            try:
                return getattr(stub, name)(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.CANCELLED and self._stub is not stub:
                    # another thread of this client found the leader again meanwhile and closed
                    # the channel this call was on (``_use``): a failover step, retried like one
                    raise Unavailable(f"the call to {leader} was cut by a switch of leader") from None
                raise from_rpc_error(exc, leader) from None
            except ValueError:  # grpc: "Cannot invoke RPC on closed channel!"
                if self._stub is not stub:  # closed by another thread's switch before the call began
                    raise Unavailable(f"the call to {leader} began on a channel a switch of leader closed") from None
                raise

        def rediscover(err: BaseException) -> None:
            log.info("directory at %s: %s; finding the leader again", self._leader, err)
            with self._lock:
                self._stub = None

        def redirected() -> Any:
            return retry_call(once, FAILOVER_REDIRECT, lambda e: isinstance(e, NotLeader | Unavailable), rediscover)

        if self._stub is None:
            self.discover()  # not finding a leader at all is not retried here
        return retry_call(redirected, BUSY_RETRY, lambda e: isinstance(e, TenantBusy))

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = None
            self._stub = None
        if self._owns_etcd and self.etcd is not None:
            self.etcd.close()


Call = Callable[..., Any]
