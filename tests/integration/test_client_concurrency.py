"""PoolClient under concurrency and failure: threads sharing one client, two processes
writing the same blocks, a writer that dies between PutStart and PutCommit (reclaimed, and
its late writes never become wrong bytes for anyone), lease releases riding on the next
call, and the asyncio twin against the same daemon."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import REPO_ROOT, DaemonHandle, writable_arena

from kvpool import KVSpec, PoolClient
from kvpool.client.async_client import AsyncPoolClient
from kvpool.core.errors import CapacityExhausted
from kvpool.core.hashing import pack_hashes
from kvpool.proto import pool_pb2, pool_pb2_grpc

SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
WAIT_S = 20.0
SHARED_TOKENS = list(range(10**6, 10**6 + 32))  # disjoint from every per-thread prompt


def make_blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**16, (n, *SPEC.block_shape), dtype=np.uint16).view(np.float16)


def stats(address: str) -> dict[str, Any]:
    with grpc.insecure_channel(address) as channel:
        reply = pool_pb2_grpc.PoolStub(channel).Stats(pool_pb2.StatsRequest(), timeout=10)
    result: dict[str, Any] = json.loads(reply.json)
    return result


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_threads_sharing_one_client_read_their_own_bytes(pool_daemon: DaemonHandle) -> None:
    errors: list[BaseException] = []
    with PoolClient.connect(pool_daemon.address, SPEC) as client:

        def worker(t: int) -> None:
            try:
                for round_ in range(5):
                    tokens = [t * 100_000 + round_ * 1000 + i for i in range(16 * 3)]
                    hashes = client.hashes(tokens)
                    blocks = make_blocks(3, seed=t * 10 + round_)
                    client.put(hashes, blocks)
                    assert client.get(hashes).tobytes() == blocks.tobytes()
                    shared = client.hashes(SHARED_TOKENS)  # every thread also races on one prefix
                    client.put(shared, make_blocks(2, seed=999))
                    assert client.get(shared).tobytes() in (b"", make_blocks(2, seed=999).tobytes())
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        shared = client.hashes(SHARED_TOKENS)
        assert client.get(shared).tobytes() == make_blocks(2, seed=999).tobytes()
        assert stats(pool_daemon.address)["blocks"] == 4 * 5 * 3 + 2


_CHILD_SAME_WRITE = """
import sys, time, numpy as np
from kvpool import KVSpec, PoolClient
spec = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
blocks = np.random.default_rng(5).integers(0, 2**16, (8, *spec.block_shape), dtype=np.uint16).view(np.float16)
stored = present = in_flight = 0
with PoolClient.connect(sys.argv[1], spec) as c:
    warm = c.hashes(list(range(100_000, 100_000 + 16 * 8)))  # a first put maps its pages: not in the race
    c.put(warm, blocks)
    c.remove(warm)
    time.sleep(max(0.0, float(sys.argv[2]) - time.monotonic()))  # both start together
    hashes = c.hashes(list(range(16 * 8)))
    rounds = 0
    # at least 10 rounds, and on until this process stored something itself (the other one may
    # have had every block in flight in each of them)
    while rounds < 10 or (stored == 0 and rounds < 1000):
        rounds += 1
        r = c.put(hashes, blocks)
        stored += r.stored; present += r.already_present; in_flight += r.in_flight
        c.remove(hashes[::3])
        got = c.get(hashes)  # the other process may be removing or writing some: a prefix, never other bytes
        assert got.tobytes() == blocks[: got.shape[0]].tobytes()
print(stored)
"""


def test_two_processes_writing_the_same_blocks_never_mix_bytes(pool_daemon: DaemonHandle) -> None:
    start = time.monotonic() + 5.0  # CLOCK_MONOTONIC: one clock for every process of the host
    children = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_CHILD_SAME_WRITE), pool_daemon.address, str(start)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert int(out) > 0
    blocks = np.random.default_rng(5).integers(0, 2**16, (8, *SPEC.block_shape), dtype=np.uint16).view(np.float16)
    with PoolClient.connect(pool_daemon.address, SPEC) as client:
        hashes = client.hashes(list(range(16 * 8)))
        got = client.get(hashes)
        assert got.tobytes() == blocks[: got.shape[0]].tobytes()
    assert stats(pool_daemon.address)["checksum_failures"] == 0


def test_a_writer_that_dies_mid_put_is_reclaimed_and_its_late_bytes_are_never_served(
    daemon_factory: Any,
) -> None:
    daemon: DaemonHandle = daemon_factory("--put-ttl-ms", "300", "--sweep-interval-ms", "50")
    with PoolClient.connect(daemon.address, SPEC) as client:
        hashes = client.hashes(list(range(16 * 2)))
        ns = client.namespace.digest()
        with grpc.insecure_channel(daemon.address) as channel:
            stub = pool_pb2_grpc.PoolStub(channel)
            zombie = stub.PutStart(pool_pb2.HashesRequest(namespace=ns, hashes=pack_hashes(hashes[:1])), timeout=10)
        assert zombie.put_id and len(zombie.offsets) == 1
        assert client.lookup(hashes[:1]) == 0  # started, not committed: invisible
        assert client.put(hashes[:1], make_blocks(1, seed=1)).in_flight == 1  # another writer is told so
        wait_until(lambda: stats(daemon.address)["pending_puts"] == 0, "the dead put to be reclaimed")
        assert stats(daemon.address)["reclaimed_puts"] == 1
        blocks = make_blocks(2, seed=2)
        assert client.put(hashes, blocks).stored == 2  # the keys are free again
        offsets = _offsets(daemon.address, ns, hashes)
        assert zombie.offsets[0] in offsets  # the freed slot was reused
        # the zombie wakes up and writes its (stale) bytes into the slot it was once given
        writable_arena(client)[zombie.offsets[0] : zombie.offsets[0] + SPEC.block_bytes] = 0x33
        got = client.get(hashes)
        reused = offsets.index(zombie.offsets[0])
        assert got.shape[0] == reused  # a miss from the overwritten block on, never wrong bytes
        assert got.tobytes() == blocks[:reused].tobytes()
        err = _commit_error(daemon.address, zombie.put_id)
        assert err == grpc.StatusCode.NOT_FOUND  # its commit is refused: nothing of it becomes visible


def _offsets(address: str, ns: bytes, hashes: list[bytes]) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = pool_pb2_grpc.PoolStub(channel)
        reply = stub.Lease(pool_pb2.HashesRequest(namespace=ns, hashes=pack_hashes(hashes)), timeout=10)
        stub.Release(pool_pb2.ReleaseRequest(lease_ids=[reply.lease_id]), timeout=10)
    return list(reply.offsets)


def _commit_error(address: str, put_id: int) -> grpc.StatusCode | None:
    with grpc.insecure_channel(address) as channel:
        try:
            pool_pb2_grpc.PoolStub(channel).PutCommit(
                pool_pb2.PutCommitRequest(put_id=put_id, checksums=[0]), timeout=10
            )
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return, attr-defined]
    return None


def test_lease_release_rides_on_the_next_call_and_close(pool_daemon: DaemonHandle) -> None:
    client = PoolClient.connect(pool_daemon.address, SPEC)
    hashes = client.hashes(list(range(16 * 2)))
    client.put(hashes, make_blocks(2, seed=3))
    client.get(hashes)
    assert stats(pool_daemon.address)["leases_active"] == 1  # held until the next call
    client.lookup(hashes)
    assert stats(pool_daemon.address)["leases_active"] == 0
    client.get(hashes)
    client.get(hashes[:1])
    assert stats(pool_daemon.address)["leases_active"] == 1  # the first released by the second
    client.close()
    assert stats(pool_daemon.address)["leases_active"] == 0
    assert stats(pool_daemon.address)["expired_leases"] == 0


def test_soft_pin_through_the_client(daemon_factory: Any) -> None:
    daemon: DaemonHandle = daemon_factory(
        "--slab-bytes", "256KiB", "--high-watermark", "1.0", "--low-watermark", "1.0", capacity="256KiB"
    )
    slots = (256 << 10) // SPEC.block_bytes
    with PoolClient.connect(daemon.address, SPEC) as client:
        hashes = client.hashes(list(range(16 * (slots + 1))))
        client.put(hashes[:slots], make_blocks(slots, seed=4))
        assert client.pin(hashes[:slots], ttl_ms=60_000) == slots
        with pytest.raises(CapacityExhausted):  # soft-pinned blocks are not evicted before their TTL
            client.put(hashes[slots:], make_blocks(1, seed=5))
        assert client.unpin(hashes[:1]) == 1
        assert client.put(hashes[slots:], make_blocks(1, seed=5)).stored == 1
        assert client.lookup(hashes[:1]) == 0 and client.lookup(hashes[1:]) == slots


def test_async_client_round_trip_with_the_sync_one(pool_daemon: DaemonHandle) -> None:
    blocks = make_blocks(3, seed=6)

    async def main() -> tuple[int, int, bytes, int]:
        async with await AsyncPoolClient.connect(pool_daemon.address, SPEC, salt=b"a") as aclient:
            hashes = aclient.hashes(list(range(16 * 4)))
            result = await aclient.put(hashes[:3], blocks)
            n = await aclient.lookup(hashes)
            got = await aclient.get(hashes)
            removed = await aclient.remove(hashes[2:])
            return result.stored, n, got.tobytes(), removed

    stored, n, got, removed = asyncio.run(main())
    assert (stored, n, removed) == (3, 3, 1)
    assert got == blocks.tobytes()
    with PoolClient.connect(pool_daemon.address, SPEC, salt=b"a") as client:
        hashes = client.hashes(list(range(16 * 4)))
        assert client.get(hashes).tobytes() == blocks[:2].tobytes()
