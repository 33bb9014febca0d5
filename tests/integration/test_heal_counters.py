"""A bad block heals, and the counters are true (issue 11, items 2 and 3), on a real daemon.

Healing: bytes flipped in the arena after commit make the next read a miss; the reader
reports the block (``ReportCorrupt``), the daemon re-verifies it, drops it, counts it in
``checksum_failures``, stops counting it in lookups and sends REMOVED; the engine's re-put
stores fresh bytes and the next read hits. A report on a good block, or on another
namespace's block, drops nothing.

Counters: exact lookup and read counts (blocks, tokens, per tier, per namespace, hit rate)
after a known sequence of calls, and what ``kvpool inspect stats`` prints.
"""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import lmdb
import numpy as np
from conftest import REPO_ROOT, DaemonHandle, start_daemon, writable_arena

from kvpool import KVSpec, PoolClient
from kvpool.client.async_client import AsyncPoolClient
from kvpool.core.hashing import pack_hashes
from kvpool.core.spec import Namespace
from kvpool.proto import pool_pb2, pool_pb2_grpc

SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
TOKENS = list(range(3000, 3000 + 16 * 6))  # 6 full blocks


def make_blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**16, size=(n, *SPEC.block_shape), dtype=np.uint16).view(np.float16)


def stats(address: str, namespace: bytes = b"") -> dict[str, Any]:
    with grpc.insecure_channel(address) as channel:
        reply = pool_pb2_grpc.PoolStub(channel).Stats(pool_pb2.StatsRequest(namespace=namespace), timeout=10)
    return dict(json.loads(reply.json))


def arena_offsets(address: str, namespace: Namespace, hashes: list[bytes]) -> list[int]:
    """Where the blocks sit in the arena (a lease, released at once; counted as one read)."""
    with grpc.insecure_channel(address) as channel:
        stub = pool_pb2_grpc.PoolStub(channel)
        reply = stub.Lease(pool_pb2.HashesRequest(namespace=namespace.digest(), hashes=pack_hashes(hashes)), timeout=10)
        stub.Release(pool_pb2.ReleaseRequest(lease_ids=[reply.lease_id]), timeout=10)
    return list(reply.offsets)


def events_from(address: str, namespace: bytes, from_seq: int) -> list[pool_pb2.Event]:
    """This namespace's events from ``from_seq`` on, as many as arrive within 2 s."""
    out: list[pool_pb2.Event] = []
    with grpc.insecure_channel(address) as channel:
        stream = pool_pb2_grpc.PoolStub(channel).Events(
            pool_pb2.EventsRequest(from_seq=from_seq, namespace=namespace), timeout=2
        )
        try:
            out.extend(stream)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
    return out


def test_a_corrupted_arena_block_is_reported_dropped_counted_and_healed_by_the_next_put(
    pool_daemon: DaemonHandle,
) -> None:
    address = pool_daemon.address
    blocks = make_blocks(4, seed=21)
    with PoolClient.connect(address, SPEC, salt=b"tenant-a") as client:
        hashes = client.hashes(TOKENS)[:4]
        assert client.put(hashes, blocks).stored == 4
        seq_after_put, _ = client.snapshot()
        writable_arena(client)[arena_offsets(address, client.namespace, hashes)[2] + 100] ^= 0x5A  # rot after commit

        got = client.get(hashes)
        assert got.shape[0] == 2 and got.tobytes() == blocks[:2].tobytes()  # a miss from block 2 on
        s = stats(address)
        assert s["checksum_failures"] == 1 and s["blocks"] == 3
        assert client.lookup(hashes) == 2  # the daemon no longer counts block 2
        _, held = client.snapshot()
        assert hashes[2] not in held and hashes[3] in held
        events = events_from(address, client.namespace.digest(), seq_after_put + 1)
        assert [(e.kind, e.hashes) for e in events] == [("removed", hashes[2])]

        healed = client.put(hashes, blocks)  # the engine recomputed and re-puts: fresh bytes stored
        assert (healed.stored, healed.already_present) == (1, 3)
        again = client.get(hashes)
        assert again.shape[0] == 4 and again.tobytes() == blocks.tobytes()
        assert stats(address)["checksum_failures"] == 1


def test_the_async_client_reports_a_corrupted_block_too(pool_daemon: DaemonHandle) -> None:
    address = pool_daemon.address
    blocks = make_blocks(3, seed=24)

    async def scenario() -> tuple[int, int, int]:
        async with await AsyncPoolClient.connect(address, SPEC, salt=b"tenant-a") as client:
            hashes = client.hashes(TOKENS)[:3]
            await client.put(hashes, blocks)
            writable_arena(client)[arena_offsets(address, client.namespace, hashes)[0] + 1] ^= 0x01
            out = np.zeros((3, *SPEC.block_shape), dtype=np.float16)
            missed = await client.get_into(hashes, out)
            after = await client.lookup(hashes)
            stored = (await client.put(hashes, blocks)).stored
            return missed, after, stored

    assert asyncio.run(scenario()) == (0, 0, 1)  # a miss; dropped; the re-put stores fresh bytes
    assert stats(address)["checksum_failures"] == 1


def test_a_false_report_or_a_report_for_another_namespace_drops_nothing(pool_daemon: DaemonHandle) -> None:
    address = pool_daemon.address
    blocks = make_blocks(4, seed=22)
    with (
        PoolClient.connect(address, SPEC, salt=b"tenant-a") as a,
        PoolClient.connect(address, SPEC, salt=b"tenant-b") as b,
    ):
        hashes = a.hashes(TOKENS)[:4]
        a.put(hashes, blocks)
        assert a.report_corrupt(hashes) == 0  # every block verifies: a report alone drops nothing
        assert a.lookup(hashes) == 4 and stats(address)["checksum_failures"] == 0

        writable_arena(a)[arena_offsets(address, a.namespace, hashes)[1] + 7] ^= 0xFF  # A's block 1 really is bad
        assert b.report_corrupt(hashes) == 0  # B's report names B || hash: none of A's blocks
        raw = pool_pb2.HashesRequest(namespace=b.namespace.digest(), hashes=pack_hashes(hashes))
        with grpc.insecure_channel(address) as channel:
            assert pool_pb2_grpc.PoolStub(channel).ReportCorrupt(raw, timeout=10).dropped == 0
        assert a.lookup(hashes) == 4 and stats(address)["checksum_failures"] == 0

        assert a.report_corrupt([hashes[1]]) == 1  # A's own report: re-verified, bad, dropped
        assert a.lookup(hashes) == 1 and stats(address)["checksum_failures"] == 1
        assert a.report_corrupt([hashes[1]]) == 0  # already gone: nothing more to drop
        many = a.hashes(list(range(16 * 17)))  # 17 blocks: more than one report may name
        assert a.report_corrupt(many) == 0  # refused (InvalidArgument, logged), nothing dropped
        raw_many = pool_pb2.HashesRequest(namespace=a.namespace.digest(), hashes=pack_hashes(many))
        with grpc.insecure_channel(address) as channel:
            try:
                pool_pb2_grpc.PoolStub(channel).ReportCorrupt(raw_many, timeout=10)
                raise AssertionError("a report of 17 blocks must be refused")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit is 16" in str(exc.details())


def test_lookup_and_read_counters_are_exact(pool_daemon: DaemonHandle) -> None:
    address = pool_daemon.address
    bt = SPEC.block_tokens
    with (
        PoolClient.connect(address, SPEC, salt=b"tenant-a") as a,
        PoolClient.connect(address, SPEC, salt=b"tenant-b") as b,
    ):
        hashes = a.hashes(TOKENS)  # 6 blocks
        before = stats(address)
        assert before["lookup_hit_rate"] is None and before["lookup_missed_blocks"] == 0

        assert a.lookup(hashes) == 0  # cold: 6 missed, nothing hit
        s = stats(address)
        assert (s["lookup_calls"], s["lookup_hit_blocks"], s["lookup_missed_blocks"]) == (1, 0, 6)
        assert s["lookup_missed_tokens"] == 6 * bt and s["lookup_hit_rate"] == 0.0

        a.put(hashes[:4], make_blocks(4, seed=23))
        assert a.lookup(hashes) == 4  # 4 hit (host), 2 missed
        assert a.lookup([*hashes[:4], hashes[5]]) == 4  # 4 hit, 1 missed
        assert b.lookup(hashes) == 0  # B's namespace: 6 missed (its keys are B || hash)

        out = np.empty((6, *SPEC.block_shape), dtype=np.float16)
        assert a.get(hashes[:4]).shape[0] == 4  # one read of 4 blocks
        assert a.get_into(hashes[:4], out) == 4  # another read of the same 4
        assert a.get_into(hashes, out) == 4  # 4 served, 2 not

        s = stats(address, a.namespace.digest())
        assert (s["lookup_calls"], s["lookup_hit_blocks"], s["lookup_missed_blocks"]) == (4, 8, 15)
        assert (s["lookup_hit_tokens"], s["lookup_missed_tokens"]) == (8 * bt, 15 * bt)
        assert s["lookup_hit_blocks_by_tier"] == {"host": 8, "device": 0, "disk": 0}
        assert s["lookup_hit_tokens_by_tier"]["host"] == 8 * bt
        assert s["lookup_hit_rate"] == 8 / 23
        assert (s["read_calls"], s["read_hit_blocks"], s["read_missed_blocks"]) == (3, 12, 2)
        assert (s["read_hit_tokens"], s["read_missed_tokens"]) == (12 * bt, 2 * bt)
        assert (s["hits"], s["misses"]) == (12, 2)  # the store's read counters agree

        by_digest = {ns["digest"]: ns for ns in s["namespaces"]}  # loopback: the admin view lists both
        mine = by_digest[a.namespace.digest().hex()]  # A's entry: only A's calls
        assert (mine["lookup_calls"], mine["lookup_hit_blocks"], mine["lookup_missed_blocks"]) == (3, 8, 9)
        assert mine["lookup_hit_rate"] == 8 / 17
        assert (mine["read_calls"], mine["read_hit_blocks"], mine["read_missed_blocks"]) == (3, 12, 2)
        theirs = by_digest[b.namespace.digest().hex()]
        assert (theirs["lookup_calls"], theirs["lookup_hit_blocks"], theirs["lookup_missed_blocks"]) == (1, 0, 6)
        assert theirs["lookup_hit_rate"] == 0.0 and theirs["read_calls"] == 0

    human = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "inspect", "stats", "--address", address],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert human.returncode == 0, human.stderr
    assert "34.8% (8 of 23 blocks)" in human.stdout  # hit rate (lookups)
    assert "lookup misses (blocks)" in human.stdout and "host=8" in human.stdout
    listed = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "inspect", "namespaces", "--address", address],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert "47.1% (8 of 17 blocks)" in listed.stdout  # tenant A (the lookup hit rate column)
    assert "0.0% (0 of 6 blocks)" in listed.stdout  # tenant B
    top = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "top", "--iterations", "1", "--address", address],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert top.returncode == 0, top.stderr
    assert "lookup hit rate 34.8% (8 of 23 blocks)" in top.stdout


DISK_SPEC = KVSpec(model="heal-disk", num_layers=1, num_kv_heads=1, head_dim=64, dtype="float32", block_tokens=16)


def test_a_block_corrupted_on_disk_is_dropped_counted_removed_and_healed(tmp_path: Path) -> None:
    """The disk tier through a real daemon: a 1 MiB host demotes the first blocks of a
    200-block prompt to disk; one of them is damaged in its slab file; its promotion fails the
    check: a miss, counted, REMOVED, no longer looked up; the re-put stores it and it hits."""
    disk_dir = tmp_path / "disk"
    daemon = start_daemon(
        "--slab-bytes", "262144", "--disk-dir", str(disk_dir), "--disk-capacity-bytes", str(64 << 20),
        "--disk-slab-file-bytes", str(8 << 20), capacity="1MiB",
    )  # fmt: skip
    try:
        rng = np.random.default_rng(25)
        data = rng.standard_normal((200, *DISK_SPEC.block_shape)).astype(np.float32)
        with PoolClient.connect(daemon.address, DISK_SPEC, salt=b"tenant-a") as client:
            hashes = client.hashes(np.arange(200 * DISK_SPEC.block_tokens))
            for start in range(0, 200, 50):
                assert client.put(hashes[start : start + 50], data[start : start + 50]).stored == 50
            key = client.namespace.digest() + hashes[0]  # the least recently used: on disk only
            assert eventually(lambda: disk_entry(disk_dir, key) is not None)
            f, offset = disk_entry(disk_dir, key) or (0, 0)
            with (disk_dir / "slabs" / f"slab-{f:05d}.kvd").open("r+b") as fh:
                fh.seek(offset + 100)
                fh.write(b"\xde\xad\xbe\xef")
            assert client.lookup(hashes[:1]) == 1  # still listed: nothing has read it yet

            assert client.get(hashes[:1]).shape[0] == 0  # its promotion fails the check: a miss
            s = stats(daemon.address)
            assert s["checksum_failures"] == 1 and s["tiers"]["disk"]["checksum_failures"] == 1
            assert client.lookup(hashes[:1]) == 0
            removed = [e for e in events_from(daemon.address, client.namespace.digest(), 1) if e.kind == "removed"]
            assert any(hashes[0] in [e.hashes[i : i + 16] for i in range(0, len(e.hashes), 16)] for e in removed)

            assert client.put(hashes[:1], data[:1]).stored == 1  # fresh bytes, not already_present
            again = client.get(hashes[:1])
            assert again.shape[0] == 1 and again.tobytes() == data[0].tobytes()
    finally:
        daemon.stop()
        daemon.cleanup()


def disk_entry(disk_dir: Path, key: bytes) -> tuple[int, int] | None:
    """(slab file, offset) of ``key`` in the disk index, read straight from LMDB."""
    env = lmdb.open(str(disk_dir / "index.lmdb"), max_dbs=2, readonly=True, lock=False)
    try:
        with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
            value = txn.get(key)
    finally:
        env.close()
    if value is None:
        return None
    f, offset = struct.unpack_from("<IQ", value)
    return int(f), int(offset)


def eventually(condition: Callable[[], bool], bound_s: float = 20.0) -> bool:
    """Poll a condition (behaviour, not timing: the bound only stops a hung test)."""
    deadline = time.monotonic() + bound_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_reference_engine_recomputes_a_corrupted_block_once_and_then_hits_again(
    pool_daemon: DaemonHandle,
) -> None:
    """End to end (issue 11: "the next request after a recompute hits again"): the reference
    engine stores a prompt, a block rots in the arena, the next request reads a prefix up
    to it, recomputes the rest and re-puts the rotten block, and the request after that hits
    every usable block; every output equals the first one."""
    import torch

    from kvpool.engine.engine import Engine, EngineConfig, SamplingParams
    from kvpool.engine.model import ModelConfig, RefModel

    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=256, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)
    model = RefModel(mc)
    config = EngineConfig(num_pages=64, page_tokens=4, block_tokens=8)
    prompt = torch.randint(0, mc.vocab_size, (41,), generator=torch.Generator().manual_seed(4)).tolist()
    with PoolClient.connect(pool_daemon.address, model.kv_spec(8)) as pool:

        def run(rid: str) -> tuple[Engine, Any]:
            engine = Engine(mc, config, pool, model=model)
            req = engine.add_request(rid, prompt, SamplingParams(3))
            engine.run_until_done()
            return engine, req

        _, first = run("a")
        hashes = pool.hashes(prompt)
        assert pool.lookup(hashes) == 5
        writable_arena(pool)[arena_offsets(pool_daemon.address, pool.namespace, hashes)[2] + 3] ^= 0x08

        engine, second = run("b")  # blocks 0-1 read; 2 fails: recomputed, reported, re-put
        assert engine.load_errors == 3 and second.hit_tokens == 16 and second.output == first.output
        assert stats(pool_daemon.address)["checksum_failures"] == 1

        engine, third = run("c")  # the usable blocks (0-4: the last prompt token always runs) all hit
        assert engine.load_errors == 0 and third.hit_tokens == 40 and third.output == first.output
