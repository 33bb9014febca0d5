"""Per-tenant arenas against a real daemon with ``--credentials`` (docs/security.md).

- Tenant B's client, in its own process, maps the arena through kvpool's library, stores and
  reads its own blocks, and then looks for tenant A's: every offset of A's blocks lies in a
  ``PROT_NONE`` range of B's ``/proc/self/maps`` (no file behind it), the hand-off refuses
  B the segment, and a raw read of one of A's offsets in a forked child dies with SIGSEGV
  (a read of B's own block in the same way returns its bytes).
- A still reads its blocks zero-copy: ``arena[offset]`` of its own mapping is its bytes.
- Capacity is shared: A fills the whole arena; B's put then empties one of A's segments
  (eviction within A's share first, then a whole segment) and stores there; after A's
  blocks are removed, B gets every segment. A segment that changed owner has fresh memory,
  so A's stale mapping never shows B's bytes, and A maps the new one when it gets it back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
from test_auth import SPEC, TOKEN_A, TOKEN_B, make_blocks, write_credentials

from kvpool import PoolClient
from kvpool.core.arena_segments import SegmentedMapping
from kvpool.core.errors import PermissionDenied
from kvpool.proto import pool_pb2
from kvpool.transport.arena_handoff import receive_arena_segment

SEGMENT_BYTES = 2 << 20
CAPACITY_BYTES = 16 << 20
BLOCKS_PER_ARENA = CAPACITY_BYTES // SPEC.block_bytes  # 16 KiB blocks, no padding
BLOCKS_PER_SEGMENT = SEGMENT_BYTES // SPEC.block_bytes

PROBE_B = textwrap.dedent(
    """
    import ctypes, json, os, signal, sys
    import numpy as np
    from kvpool import KVSpec, PoolClient
    from kvpool.core.errors import PermissionDenied
    from kvpool.transport.arena_handoff import receive_arena_segment
    address, token, offsets = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    spec = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
    b = PoolClient.connect(address, spec, salt=b"salt-b", token=token)
    blocks = np.random.default_rng(5).integers(0, 2**16, size=(4, *spec.block_shape), dtype=np.uint16)
    hashes = b.hashes(range(64))
    assert b.put(hashes, blocks.view(np.float16)).stored == 4
    own_ok = b.get(hashes).tobytes() == blocks.tobytes()
    lease = b._rpc("Lease", b._hashes_request(hashes))
    base = b.arena.ctypes.data
    seg_bytes = b._arena.segment_bytes

    def region(address):  # (perms, path) of the mapping of this process holding address
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split()
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= address < hi:
                    return parts[1], parts[5] if len(parts) > 5 else ""
        return "unmapped", ""

    def dies_reading(address):  # a raw read in a forked child: its exit signal (0 = it read)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGSEGV, signal.SIG_DFL)
            ctypes.string_at(address, 64)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        return os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0

    refused = 0
    for seg in sorted({off // seg_bytes for off in offsets}):
        try:
            os.close(receive_arena_segment(b._arena.path, "r", 0, seg, token)[0])
        except PermissionDenied:
            refused += 1
    print(json.dumps({
        "own_ok": own_ok,
        "own_region": region(base + lease.offsets[0]),
        "own_read_signal": dies_reading(base + lease.offsets[0]),
        "a_regions": [region(base + off) for off in offsets],
        "a_read_signals": [dies_reading(base + off) for off in offsets[:2]],
        "a_segments_refused": refused,
        "a_segments": len({off // seg_bytes for off in offsets}),
        "mapped_segments": b._arena.mapped_segments(),
    }))
    b.close()
    """
)


@pytest.fixture
def segmented(daemon_factory: Any, tmp_path: Any) -> Any:
    """A daemon with credentials (tenants A and B) and an arena of 8 segments of 2 MiB."""
    return daemon_factory(
        "--credentials", write_credentials(str(tmp_path)),
        "--slab-bytes", "1MiB", "--arena-segment-bytes", "2MiB",
        "--high-watermark", "1.0", "--low-watermark", "1.0",
        capacity="16MiB",
    )  # fmt: skip


def offsets_of(client: PoolClient, hashes: list[bytes]) -> list[int]:
    lease = client._rpc("Lease", client._hashes_request(hashes))
    client._release_later(int(lease.lease_id))
    return [int(o) for o in lease.offsets]


def test_another_tenants_client_cannot_read_a_blocks_through_its_mapping(segmented: Any) -> None:
    with PoolClient.connect(segmented.address, SPEC, salt=b"salt-a", token=TOKEN_A) as a:
        hashes = a.hashes(range(16 * 8))
        blocks = make_blocks(8, seed=41)
        assert a.put(hashes, blocks).stored == 8
        np.testing.assert_array_equal(a.get(hashes), blocks)
        offsets = offsets_of(a, hashes)
        # zero-copy: A's own mapping holds its bytes at the offsets the lease named
        expected = blocks.reshape(8, -1).view(np.uint8)
        for i, off in enumerate(offsets):
            view = a.arena[off : off + SPEC.block_bytes]
            assert np.shares_memory(view, a.arena) and np.array_equal(view, expected[i])
        done = subprocess.run(
            [sys.executable, "-c", PROBE_B, segmented.address, TOKEN_B, json.dumps(offsets)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
    assert got["own_ok"] and got["own_read_signal"] == 0 and "memfd:kvpool-arena-" in got["own_region"][1]
    assert got["a_regions"] and all(perms == "---p" and "memfd" not in path for perms, path in got["a_regions"])
    assert got["a_read_signals"] == [signal.SIGSEGV, signal.SIGSEGV]  # a touch is a SIGSEGV, never a read
    assert got["a_segments_refused"] == got["a_segments"] >= 1
    assert not {off // SEGMENT_BYTES for off in offsets} & set(got["mapped_segments"])


def test_capacity_freed_by_one_tenant_is_usable_by_another(segmented: Any) -> None:
    with (
        PoolClient.connect(segmented.address, SPEC, salt=b"salt-a", token=TOKEN_A) as a,
        PoolClient.connect(segmented.address, SPEC, salt=b"salt-b", token=TOKEN_B) as b,
    ):
        assert isinstance(a._arena, SegmentedMapping) and a._arena.num_segments == 8
        a_hashes = a.hashes(range(16 * BLOCKS_PER_ARENA))
        a_blocks = make_blocks(BLOCKS_PER_ARENA, seed=42)
        for lo in range(0, BLOCKS_PER_ARENA, 128):
            assert a.put(a_hashes[lo : lo + 128], a_blocks[lo : lo + 128]).stored == 128
        assert a.lookup(a_hashes) == BLOCKS_PER_ARENA and sorted(a._arena.mapped_segments()) == list(range(8))
        np.testing.assert_array_equal(a.get(a_hashes[:64]), a_blocks[:64])
        # B has no segment: its put empties one of A's (whole) and stores there
        b_hashes = b.hashes(range(10**6, 10**6 + 16 * 2 * BLOCKS_PER_SEGMENT))
        b_blocks = make_blocks(2 * BLOCKS_PER_SEGMENT, seed=43)
        assert b.put(b_hashes[:BLOCKS_PER_SEGMENT], b_blocks[:BLOCKS_PER_SEGMENT]).stored == BLOCKS_PER_SEGMENT
        b_offsets = offsets_of(b, b_hashes[:BLOCKS_PER_SEGMENT])
        (b_seg,) = {off // SEGMENT_BYTES for off in b_offsets}
        a_left = sum(1 for h in a_hashes if a.lookup([h]))
        assert a_left == BLOCKS_PER_ARENA - BLOCKS_PER_SEGMENT  # exactly one segment of A's went
        np.testing.assert_array_equal(b.get(b_hashes[:BLOCKS_PER_SEGMENT]), b_blocks[:BLOCKS_PER_SEGMENT])
        # A's old mapping of that segment shows A's old bytes or nothing, never B's
        b_bytes = b_blocks.reshape(len(b_blocks), -1).view(np.uint8)
        for i, off in enumerate(b_offsets[:8]):
            assert not np.array_equal(a.arena[off : off + SPEC.block_bytes], b_bytes[i])
        with pytest.raises(PermissionDenied):  # and it cannot get the new one
            receive_arena_segment(a._arena.path, "r", 0, b_seg, TOKEN_A)
        # A's blocks removed: B can take every segment
        assert a.remove(a_hashes) == a_left
        for lo in range(0, BLOCKS_PER_ARENA, 128):
            chunk = b.hashes(range(2 * 10**6 + 16 * lo, 2 * 10**6 + 16 * (lo + 128)))
            assert b.put(chunk, make_blocks(128, seed=lo)).stored == 128
        assert sorted(b._arena.mapped_segments()) == list(range(8))
        assert a.put(a_hashes[:4], a_blocks[:4]).stored == 4  # A gets a segment back (B's LRU one emptied)
        np.testing.assert_array_equal(a.get(a_hashes[:4]), a_blocks[:4])  # mapped again at its new generation
        stats = a.stats()
        assert stats["blocks"] <= BLOCKS_PER_ARENA
        assert stats["arena_segment_bytes"] == SEGMENT_BYTES and stats["arena_segments_renewed"] >= 9


def test_a_tenant_cannot_ask_for_a_writable_segment_of_another(segmented: Any) -> None:
    with (
        PoolClient.connect(segmented.address, SPEC, salt=b"salt-a", token=TOKEN_A) as a,
        PoolClient.connect(segmented.address, SPEC, salt=b"salt-b", token=TOKEN_B) as b,
    ):
        hashes = a.hashes(range(64))
        assert a.put(hashes, make_blocks(4, seed=44)).stored == 4
        (seg_a,) = {off // SEGMENT_BYTES for off in offsets_of(a, hashes)}
        start = b._rpc("PutStart", b._hashes_request(b.hashes(range(64))))
        assert start.put_id != 0 and len(start.segment_generations) == len(start.offsets)
        with pytest.raises(PermissionDenied):  # B holds a put, but not of A's segment
            receive_arena_segment(b._arena.path, "w", start.put_id, seg_a, TOKEN_B)
        seg_b = start.offsets[0] // SEGMENT_BYTES
        fd, generation = receive_arena_segment(b._arena.path, "w", start.put_id, seg_b, TOKEN_B)
        os.close(fd)
        assert generation == start.segment_generations[0]
        b._rpc("PutAbort", pool_pb2.PutAbortRequest(put_id=start.put_id))
