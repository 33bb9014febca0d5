# The native one-pass copy + xxh3-64 kernel (_xxh3copy.c); kvpool/core/checksum.py wraps it,
# kvpool/transport/recv_rows.py its receive-and-hash.
# dst / src: any C-contiguous buffer (numpy arrays, bytearray, memoryview; dst writable).
from collections.abc import Sequence
from typing import Any

KERNEL: str  # "avx2" or "scalar"
MIN_BLOCK_BYTES: int  # 241: shorter blocks take XXH3's short paths (the xxhash package)

def copy_blocks(dst: Any, src: Any, block_bytes: int, scalar: bool = False, stream: bool = False, /) -> list[int]: ...
def hash_blocks(src: Any, block_bytes: int, scalar: bool = False, /) -> list[int]: ...

# (digests of the rows received whole, status, errno): kvpool/transport/recv_rows.py
def recv_rows(
    fd: int, rows: Sequence[Any], timeout_s: float, piece_bytes: int, scalar: bool = False, /
) -> tuple[list[int], int, int]: ...
