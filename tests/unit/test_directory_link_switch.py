"""A client's directory link is shared by its threads: when one of them finds the leader again
(a failover) it closes the channel the others may still have a call on, which gRPC then
cancels. That call is a failover step, retried on the new channel, not an INTERNAL error
(seen in a fresh-clone CI: a management call failed with "CANCELLED Channel closed!" while
another thread rediscovered; and a call that only began after the close, which gRPC refuses
with a ValueError, "Cannot invoke RPC on closed channel!"). Against a real directory server,
in-process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kvpool.daemon.cluster_local import free_port
from kvpool.directory.link import DirectoryLink
from kvpool.directory.server import DirectoryConfig, DirectoryServer
from kvpool.proto import directory_pb2


class Cancelled(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "Channel closed!"


@pytest.fixture
def directory() -> Iterator[str]:
    address = f"127.0.0.1:{free_port()}"
    server = DirectoryServer(DirectoryConfig(listen=address))
    server.start()
    yield address
    server.stop()


def test_a_call_cut_by_another_threads_switch_of_channel_is_retried(directory: str) -> None:
    link = DirectoryLink([directory], timeout_s=2.0)
    try:
        link.discover()
        calls: list[str] = []

        class CutStub:
            """The stub of a channel another thread replaces (and closes) during the call."""

            def Nodes(self, request: Any, **kwargs: Any) -> Any:
                calls.append("cut")
                link._use("127.0.0.1:1")  # the other thread's switch: this channel is closed now
                link._stub = None  # ...and it is finding the leader again
                raise Cancelled()

        link._stub = CutStub()  # type: ignore[assignment]
        reply = link.call("Nodes", directory_pb2.NodesRequest())
        assert calls == ["cut"] and isinstance(reply, directory_pb2.NodesReply)
        assert link.leader == directory
    finally:
        link.close()


def test_a_cancelled_call_on_the_current_channel_is_still_an_error(directory: str) -> None:
    from kvpool.core.errors import InternalError

    link = DirectoryLink([directory], timeout_s=2.0)
    try:
        link.discover()

        class CancelledStub:
            def Nodes(self, request: Any, **kwargs: Any) -> Any:
                raise Cancelled()

        link._stub = CancelledStub()  # type: ignore[assignment]
        with pytest.raises(InternalError, match="CANCELLED"):
            link.call("Nodes", directory_pb2.NodesRequest())
    finally:
        link.close()


def test_a_call_begun_on_a_channel_another_thread_closed_is_retried(directory: str) -> None:
    link = DirectoryLink([directory], timeout_s=2.0)
    try:
        link.discover()
        calls: list[str] = []

        class ClosedStub:
            """The stub of a channel another thread closed just before this call began."""

            def Nodes(self, request: Any, **kwargs: Any) -> Any:
                calls.append("closed")
                link._use("127.0.0.1:1")
                link._stub = None
                raise ValueError("Cannot invoke RPC on closed channel!")

        link._stub = ClosedStub()  # type: ignore[assignment]
        reply = link.call("Nodes", directory_pb2.NodesRequest())
        assert calls == ["closed"] and isinstance(reply, directory_pb2.NodesReply)
    finally:
        link.close()


def test_a_value_error_on_the_current_channel_is_not_hidden(directory: str) -> None:
    link = DirectoryLink([directory], timeout_s=2.0)
    try:
        link.discover()

        class BrokenStub:
            def Nodes(self, request: Any, **kwargs: Any) -> Any:
                raise ValueError("something else")

        link._stub = BrokenStub()  # type: ignore[assignment]
        with pytest.raises(ValueError, match="something else"):
            link.call("Nodes", directory_pb2.NodesRequest())
    finally:
        link.close()
