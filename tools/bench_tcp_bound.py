"""The ceiling of any TCP reader on this host: the bytes of a batch over one loopback TCP
connection from another process, and nothing else.

    python tools/bench_tcp_bound.py [--block-kib 256] [--blocks 512] [--iters 9]

A sender process keeps the batch in a shared mapping (as a node keeps its arena) and sends
it the way a node does (``kvpool.transport.wire.send_gathered``: several blocks per
``sendmsg``); this process receives it with one ``recv_into(MSG_WAITALL)`` straight into its
buffer (the kernel fills it without returning to Python). No request framing, no lookup, no
checksum, no Python per block or piece: what is left is the kernel's two copies (the
sender's into the socket, the receiver's out of it) and loopback TCP.
``tools/bench_cluster.py`` times it interleaved with the systems it measures, as the row
``loopback tcp bound``: kvpool's TCP data plane / this row says how much of what TCP can
do here the whole read (lookup, request, checksum of every block) gets; a peer's figure
times the ratio it is asked to reach says whether the target fits under the ceiling.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import multiprocessing
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvpool.transport.wire import send_gathered

ROW = "loopback tcp bound"


def pattern(nbytes: int) -> np.ndarray:
    """``nbytes`` bytes that differ from one 8-byte word to the next (a misplaced piece shows)."""
    return np.arange(-(-nbytes // 8), dtype=np.uint64).view(np.uint8)[:nbytes]


def _sender(port: int, block_bytes: int, blocks: int) -> None:
    """Connect to the reader; send the whole batch for every request byte it sends, until EOF."""
    nbytes = block_bytes * blocks
    fd = os.memfd_create("kvpool-bench-tcp-bound")
    os.ftruncate(fd, nbytes)
    arena = mmap.mmap(fd, nbytes)
    np.frombuffer(arena, dtype=np.uint8)[:] = pattern(nbytes)
    view = memoryview(arena)
    rows = [view[i * block_bytes : (i + 1) * block_bytes] for i in range(blocks)]
    with socket.create_connection(("127.0.0.1", port)) as conn:
        while conn.recv(1):
            send_gathered(conn, rows)


@contextlib.contextmanager
def tcp_bound_batch(block_bytes: int, blocks: int) -> Iterator[tuple[Callable[[], None], Callable[[], None]]]:
    """(receive one batch, check the last batch's bytes), with the sender process running."""
    nbytes = block_bytes * blocks
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = multiprocessing.get_context("spawn").Process(
            target=_sender, args=(listener.getsockname()[1], block_bytes, blocks), daemon=True
        )
        sender.start()
        try:
            listener.settimeout(60)
            conn, _ = listener.accept()
        except BaseException:
            sender.kill()
            raise
    out = np.empty(nbytes, dtype=np.uint8)
    view = out.data  # a memoryview of the buffer

    def receive() -> None:
        conn.sendall(b"r")
        got = 0
        while got < nbytes:  # MSG_WAITALL: the kernel fills the buffer in one call, no Python per piece
            n = conn.recv_into(view[got:], nbytes - got, socket.MSG_WAITALL)
            if not n:
                raise EOFError(f"the sender closed after {got} of {nbytes} bytes")
            got += n

    def check() -> None:
        assert np.array_equal(out, pattern(nbytes))

    try:
        yield receive, check
    finally:
        conn.close()  # EOF: the sender returns
        sender.join(10)
        if sender.is_alive():
            sender.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--iters", type=int, default=9)
    args = parser.parse_args()
    block_bytes = args.block_kib << 10
    with tcp_bound_batch(block_bytes, args.blocks) as (receive, check):
        receive()  # warm-up: the pages of both buffers
        seconds = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            receive()
            seconds.append(time.perf_counter() - t0)
        check()
    gbps = sorted(block_bytes * args.blocks / s / 1e9 for s in seconds)
    spread = f"[{gbps[0]:.2f}-{gbps[-1]:.2f}]"
    print(f"{ROW}: {args.blocks} x {args.block_kib} KiB, GB/s median {statistics.median(gbps):.2f} {spread}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
