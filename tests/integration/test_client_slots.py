"""``PoolClient.stage_put`` / ``put_with`` / ``read_with`` against a real daemon: the
connectors' in-place path (gather straight into the put's slots, scatter straight from the
leased bytes). Same contract as ``put`` / ``get_into``: byte for byte, nothing visible before
the commit, a corrupted block and everything after it is a miss, a failing writer leaves
nothing behind."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import DaemonHandle, writable_arena
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool import KVSpec, PoolClient
from kvpool.core.hashing import pack_hashes
from kvpool.proto import pool_pb2

SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
TOKENS = list(range(5000, 5000 + 16 * 8))


def rows_of(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, SPEC.block_bytes), dtype=np.uint8)


def test_put_with_then_read_with_byte_for_byte_and_runs_are_in_order(pool_daemon: DaemonHandle) -> None:
    data = rows_of(8, seed=1)
    with PoolClient.connect(pool_daemon.address, SPEC, salt=b"slots") as client:
        hashes = client.hashes(TOKENS)
        client.put(hashes[2:3], data[2:3].view(np.float16).reshape(1, *SPEC.block_shape))  # already present
        asked: list[tuple[int, int]] = []

        def fill(first: int, count: int, rows: np.ndarray) -> None:
            assert rows.flags.writeable and rows.shape == (count, SPEC.block_bytes)
            asked.append((first, count))
            rows[:] = data[first : first + count]

        result = client.put_with(hashes, fill)
        assert (result.stored, result.already_present) == (7, 1)
        assert sorted(i for first, count in asked for i in range(first, first + count)) == [0, 1, 3, 4, 5, 6, 7]
        seen = np.zeros_like(data)
        runs: list[tuple[int, int]] = []

        def use(first: int, count: int, rows: np.ndarray) -> None:
            assert not rows.flags.writeable  # the lease's bytes are read-only to the client
            runs.append((first, count))
            seen[first : first + count] = rows

        assert client.read_with(hashes, use) == 8
        assert seen.tobytes() == data.tobytes()
        assert [i for first, count in runs for i in range(first, first + count)] == list(range(8))


def test_staged_put_is_invisible_until_commit_and_abort_stores_nothing(pool_daemon: DaemonHandle) -> None:
    data = rows_of(3, seed=2)
    with PoolClient.connect(pool_daemon.address, SPEC, salt=b"staged") as client:
        hashes = client.hashes(TOKENS)[:3]

        def fill(first: int, count: int, rows: np.ndarray) -> None:
            rows[:] = data[first : first + count]

        staged = client.stage_put(hashes, fill)
        assert staged.written_blocks == 3 and client.lookup(hashes) == 0
        assert staged.commit().stored == 3 and client.lookup(hashes) == 3
        assert staged.commit().stored == 0  # a second commit does nothing
        other = client.hashes([t + 1 for t in TOKENS])[:2]
        aborted = client.stage_put(other, fill)
        aborted.abort()
        assert client.lookup(other) == 0
        assert client.put_with(other, fill).stored == 2  # the slots were given back, the put starts afresh


def test_a_failing_fill_aborts_the_put(pool_daemon: DaemonHandle) -> None:
    with PoolClient.connect(pool_daemon.address, SPEC, salt=b"failing") as client:
        hashes = client.hashes(TOKENS)[:2]

        def fill(first: int, count: int, rows: np.ndarray) -> None:
            raise RuntimeError("engine gather failed")

        with pytest.raises(RuntimeError, match="gather failed"):
            client.stage_put(hashes, fill)
        assert client.lookup(hashes) == 0
        ok = client.put_with(hashes, lambda first, count, rows: rows.fill(7))
        assert ok.stored == 2  # not in flight: the failed put was aborted


def test_a_corrupted_block_is_not_handed_to_use_nor_anything_after_it(pool_daemon: DaemonHandle) -> None:
    data = rows_of(4, seed=3)
    with PoolClient.connect(pool_daemon.address, SPEC, salt=b"corrupt") as client:
        hashes = client.hashes(TOKENS)[:4]
        client.put_with(hashes, lambda first, count, rows: rows.__setitem__(slice(None), data[first : first + count]))
        request = pool_pb2.HashesRequest(namespace=client.namespace.digest(), hashes=pack_hashes(hashes))
        lease = client._stub.Lease(request, timeout=10)
        client._stub.Release(pool_pb2.ReleaseRequest(lease_ids=[lease.lease_id]), timeout=10)
        writable_arena(client)[lease.offsets[1] + 5] ^= 0x11
        handed: list[int] = []

        def use(first: int, count: int, rows: np.ndarray) -> None:
            handed.extend(range(first, first + count))
            assert rows.tobytes() == data[first : first + count].tobytes()

        assert client.read_with(hashes, use) == 1
        assert handed == [0]
        assert client.lookup(hashes) == 1  # reported: the node dropped block 1


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(present=st.sets(st.integers(0, 7)), seed=st.integers(0, 2**16))
def test_in_place_and_copying_paths_store_the_same_bytes(
    pool_daemon: DaemonHandle, present: set[int], seed: int
) -> None:
    """Whatever the pool already holds, ``put_with`` + ``read_with`` and ``put`` + ``get_into``
    agree on every byte (the in-place path is the copying path without the staging buffer)."""
    data = rows_of(8, seed)
    blocks = data.view(np.float16).reshape(8, *SPEC.block_shape)
    tokens = [seed * 1000 + t for t in TOKENS]
    with PoolClient.connect(pool_daemon.address, SPEC, salt=b"prop-%d" % seed) as client:
        hashes = client.hashes(tokens)
        for i in sorted(present):
            client.put(hashes[i : i + 1], blocks[i : i + 1])
        result = client.put_with(hashes, lambda f, c, rows: rows.__setitem__(slice(None), data[f : f + c]))
        assert result.stored + result.already_present == 8
        seen = np.zeros_like(data)
        assert client.read_with(hashes, lambda f, c, rows: seen.__setitem__(slice(f, f + c), rows)) == 8
        assert seen.tobytes() == client.get(hashes).view(np.uint8).reshape(8, -1).tobytes() == data.tobytes()


def test_a_read_with_that_outlives_its_lease_is_all_misses(daemon_factory: object) -> None:
    """``read_with`` verifies the leased bytes and then lets ``use`` read them: they are the
    verified bytes only while the lease holds the slots. A ``use`` that stalls past the
    daemon's lease (``--lease-ttl-ms 4000`` here) gets its read counted as 0 blocks, so the
    engine recomputes them; the same read within the lease is served."""
    daemon = daemon_factory("--lease-ttl-ms", "4000")  # type: ignore[operator]
    data = rows_of(4, seed=7)
    with PoolClient.connect(daemon.address, SPEC, salt=b"lease") as client:
        hashes = client.hashes(TOKENS[: 4 * 16])
        client.put(hashes, data.view(np.float16).reshape(4, *SPEC.block_shape))
        assert client.read_with(hashes, lambda first, count, rows: None) == 4

        def stall(first: int, count: int, rows: np.ndarray) -> None:
            time.sleep(4.5)  # the stall under test: longer than the 4,000 ms lease

        assert client.read_with(hashes, stall) == 0
        assert client.read_with(hashes, lambda first, count, rows: None) == 4  # nothing was dropped


def test_a_mapping_replaced_during_a_read_is_unavailable_not_a_stray_error(pool_daemon: DaemonHandle) -> None:
    """A re-Hello on another thread (the daemon restarted) closes the mapping a read is
    about to use: the read raises the typed ``Unavailable`` (an engine connector counts it
    as a miss), not the ``ValueError`` of an emptied view."""
    from kvpool.core.errors import Unavailable

    data = rows_of(2, seed=9)
    with PoolClient.connect(pool_daemon.address, SPEC, salt=b"remap") as client:
        hashes = client.hashes(TOKENS[: 2 * 16])
        client.put(hashes, data.view(np.float16).reshape(2, *SPEC.block_shape))
        mapping = client._arena
        assert mapping is not None
        real_ensure = mapping.ensure

        def ensure_then_remapped(*args: object, **kwargs: object) -> None:
            real_ensure(*args, **kwargs)  # type: ignore[arg-type]
            mapping.close()  # what attach_arena does to the old mapping on a re-Hello

        mapping.ensure = ensure_then_remapped  # type: ignore[method-assign]
        with pytest.raises(Unavailable, match="mapped again during this read"):
            client.get_into(hashes, np.zeros((2, *SPEC.block_shape), dtype=np.float16))
