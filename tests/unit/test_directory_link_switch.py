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


@pytest.fixture
def link(directory: str) -> Iterator[DirectoryLink]:
    link = DirectoryLink([directory], timeout_s=2.0)
    link.discover()
    yield link
    link.close()


def stub_raising(link: DirectoryLink, error: Exception, switch: bool, calls: list[str]) -> None:
    """Put a stub on ``link`` whose call raises ``error``; with ``switch``, another thread of the
    client has first switched channel (``_use`` closes this one) and is finding the leader again."""

    class Stub:
        def Nodes(self, request: Any, **kwargs: Any) -> Any:
            calls.append(type(error).__name__)
            if switch:
                link._use("127.0.0.1:1")  # the other thread's switch: this channel is closed now
                link._stub = None  # ...and it is finding the leader again
            raise error

    link._stub = Stub()  # type: ignore[assignment]


# cut during the call (gRPC cancels it), or closed just before it began (gRPC refuses it)
CUT = [Cancelled(), ValueError("Cannot invoke RPC on closed channel!")]


@pytest.mark.parametrize("error", CUT, ids=["cancelled-during", "closed-before"])
def test_a_call_on_a_channel_another_threads_switch_closed_is_retried(
    link: DirectoryLink, directory: str, error: Exception
) -> None:
    calls: list[str] = []
    stub_raising(link, error, switch=True, calls=calls)
    reply = link.call("Nodes", directory_pb2.NodesRequest())
    assert calls == [type(error).__name__] and isinstance(reply, directory_pb2.NodesReply)
    assert link.leader == directory


def test_a_cancelled_call_on_the_current_channel_is_still_an_error(link: DirectoryLink) -> None:
    from kvpool.core.errors import InternalError

    stub_raising(link, Cancelled(), switch=False, calls=[])
    with pytest.raises(InternalError, match="CANCELLED"):
        link.call("Nodes", directory_pb2.NodesRequest())


def test_a_value_error_on_the_current_channel_is_not_hidden(link: DirectoryLink) -> None:
    stub_raising(link, ValueError("something else"), switch=False, calls=[])
    with pytest.raises(ValueError, match="something else"):
        link.call("Nodes", directory_pb2.NodesRequest())
