"""``kvpool.rpc.listen.split_listen``: the one parser of every HTTP listener's address."""

from __future__ import annotations

import pytest

from kvpool.core.errors import InvalidArgument
from kvpool.rpc.listen import split_listen


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("127.0.0.1:9440", ("127.0.0.1", 9440)),
        (":0", ("127.0.0.1", 0)),  # no host: loopback, never every interface
        ("[::1]:8000", ("::1", 8000)),
        ("0.0.0.0:80", ("0.0.0.0", 80)),
    ],
)
def test_host_and_port(listen: str, expected: tuple[str, int]) -> None:
    assert split_listen(listen) == expected


@pytest.mark.parametrize("listen", ["", "9440", "host:", "host:http", "host:65536", "host:-1"])
def test_anything_else_is_a_typed_error_naming_the_flag(listen: str) -> None:
    with pytest.raises(InvalidArgument, match=r"metrics address .* is not HOST:PORT"):
        split_listen(listen, "metrics address")
