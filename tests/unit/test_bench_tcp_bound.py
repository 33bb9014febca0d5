"""tools/bench_tcp_bound.py: the loopback-TCP ceiling row of bench_cluster moves every byte,
in order, batch after batch, and stops its sender process when done."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
from bench_tcp_bound import tcp_bound_batch


@pytest.mark.parametrize(("block_bytes", "blocks"), [(4096, 3), (256 << 10, 9), (1000, 70)])
def test_each_batch_arrives_whole_and_the_sender_stops(block_bytes: int, blocks: int) -> None:
    with tcp_bound_batch(block_bytes, blocks) as (receive, check):
        for _ in range(3):
            receive()
            check()
