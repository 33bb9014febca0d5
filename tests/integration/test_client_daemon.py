"""PoolClient against a real ``kvpool serve`` subprocess, from this process and from others.

Covers the data path (put in one process, get / get_into in another, byte for byte),
torch tensors, and the "Bad input" contract: wrong shape / dtype, unknown namespace,
malformed requests, a put over capacity, a daemon that is down, a corrupted block. Each
gets a typed error (or a miss) and nothing already stored is lost or changed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import REPO_ROOT, DaemonHandle, free_port, writable_arena

from kvpool import KVSpec, PoolClient
from kvpool.client.pool_common import hello_request
from kvpool.core.checksum import checksum64
from kvpool.core.errors import (
    CapacityExhausted,
    InvalidArgument,
    KVPoolError,
    SpecMismatch,
    Unavailable,
    UnknownNamespace,
    VersionMismatch,
)
from kvpool.core.hashing import pack_hashes
from kvpool.core.spec import Namespace
from kvpool.proto import pool_pb2, pool_pb2_grpc
from kvpool.rpc.errors import from_rpc_error

SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
SALT = b"tenant-a"
TOKENS = list(range(1000, 1000 + 16 * 6))  # 6 full blocks


def make_blocks(n: int, seed: int, spec: KVSpec = SPEC) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 2**16, size=(n, *spec.block_shape), dtype=np.uint16)
    return raw.view(spec.numpy_dtype) if spec.numpy_dtype.itemsize == 2 else raw.astype(spec.numpy_dtype)


def run_child(code: str, *args: str, timeout: float = 60.0) -> str:
    """Run ``code`` in a fresh Python process (argv[1:] = args); return its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, f"child failed ({done.returncode}):\n{done.stderr}"
    return done.stdout


def stats(address: str) -> dict[str, Any]:
    with grpc.insecure_channel(address) as channel:
        reply = pool_pb2_grpc.PoolStub(channel).Stats(pool_pb2.StatsRequest(), timeout=10)
    result: dict[str, Any] = json.loads(reply.json)
    return result


def raw_call(address: str, method: str, request: Any) -> Any:
    with grpc.insecure_channel(address) as channel:
        return getattr(pool_pb2_grpc.PoolStub(channel), method)(request, timeout=10)


def expect_typed(address: str, method: str, request: Any) -> KVPoolError:
    with pytest.raises(grpc.RpcError) as info:
        raw_call(address, method, request)
    return from_rpc_error(info.value, address)


_CHILD_READ = """
import sys, numpy as np
from kvpool import KVSpec, PoolClient
spec = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
with PoolClient.connect(sys.argv[1], spec, salt=b"tenant-a") as c:
    hashes = c.hashes(list(range(1000, 1000 + 16 * 6)))
    n = c.lookup(hashes)
    got = c.get(hashes)
    out = np.zeros((len(hashes), *spec.block_shape), dtype=np.float16)
    m = c.get_into(hashes, out)
    np.save(sys.argv[2], got)
    np.save(sys.argv[3], out[:m])
    print(n, len(got), m)
"""

_CHILD_WRITE = """
import sys, numpy as np
from kvpool import KVSpec, PoolClient
spec = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
blocks = np.load(sys.argv[2])
with PoolClient.connect(sys.argv[1], spec, salt=b"tenant-a") as c:
    hashes = c.hashes(list(range(1000, 1000 + 16 * 6)))
    r = c.put(hashes[: len(blocks)], blocks)
    print(r.stored, r.already_present)
"""


def test_put_here_get_in_another_process_byte_for_byte(pool_daemon: DaemonHandle, tmp_path: Path) -> None:
    blocks = make_blocks(4, seed=1)
    with PoolClient.connect(pool_daemon.address, SPEC, salt=SALT) as client:
        hashes = client.hashes(TOKENS)
        assert len(hashes) == 6
        result = client.put(hashes[:4], blocks)
        assert (result.stored, result.already_present, result.checksum_failed) == (4, 0, 0)
        again = client.put(hashes[:4], blocks)
        assert (again.stored, again.already_present) == (0, 4)
    out = run_child(_CHILD_READ, pool_daemon.address, str(tmp_path / "got.npy"), str(tmp_path / "into.npy"))
    assert out.split() == ["4", "4", "4"]
    got, into = np.load(tmp_path / "got.npy"), np.load(tmp_path / "into.npy")
    assert got.dtype == np.float16 and got.shape == (4, *SPEC.block_shape)
    assert got.tobytes() == blocks.tobytes() and into.tobytes() == blocks.tobytes()


def test_put_in_another_process_get_here(pool_daemon: DaemonHandle, tmp_path: Path) -> None:
    blocks = make_blocks(5, seed=2)
    np.save(tmp_path / "blocks.npy", blocks)
    assert run_child(_CHILD_WRITE, pool_daemon.address, str(tmp_path / "blocks.npy")).split() == ["5", "0"]
    with PoolClient.connect(pool_daemon.address, SPEC, salt=SALT) as client:
        hashes = client.hashes(TOKENS)
        assert client.lookup(hashes) == 5
        got = client.get(hashes)
        assert got.shape[0] == 5 and got.tobytes() == blocks.tobytes()
        out = np.zeros((6, *SPEC.block_shape), dtype=np.float16)
        assert client.get_into(hashes[2:], out) == 3
        assert out[:3].tobytes() == blocks[2:].tobytes()
        assert client.get_into(hashes[5:], out) == 0
    with PoolClient.connect(pool_daemon.address, SPEC, salt=b"tenant-b") as other:
        assert other.lookup(other.hashes(TOKENS)) == 0  # another tenant sees nothing
        assert other.get(hashes).shape[0] == 0  # ...not even handed A's hashes: keys are (namespace, hash)


def test_torch_tensors_float16_and_bfloat16(pool_daemon: DaemonHandle) -> None:
    torch = pytest.importorskip("torch")
    bf_spec = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
    with PoolClient.connect(pool_daemon.address, bf_spec) as client:
        hashes = client.hashes(TOKENS)
        src = torch.randn(3, *bf_spec.block_shape, dtype=torch.bfloat16)
        assert client.put(hashes[:3], src).stored == 3
        got = client.get(hashes)
        assert got.dtype == np.uint16 and got.shape[0] == 3
        assert got.tobytes() == src.view(torch.int16).numpy().tobytes()
        out = torch.zeros(3, *bf_spec.block_shape, dtype=torch.bfloat16)
        assert client.get_into(hashes[:3], out) == 3
        assert torch.equal(out, src)
    with PoolClient.connect(pool_daemon.address, SPEC) as client:
        src16 = torch.randn(2, *SPEC.block_shape, dtype=torch.float16)
        assert client.put(client.hashes(TOKENS)[:2], src16).stored == 2
        assert np.array_equal(client.get(client.hashes(TOKENS)[:2]), src16.numpy())


def test_wrong_shape_or_dtype_is_invalid_argument_and_changes_nothing(pool_daemon: DaemonHandle) -> None:
    torch = pytest.importorskip("torch")
    blocks = make_blocks(2, seed=3)
    with PoolClient.connect(pool_daemon.address, SPEC, salt=SALT) as client:
        hashes = client.hashes(TOKENS)
        client.put(hashes[:2], blocks)
        before = stats(pool_daemon.address)
        bad_shape = np.zeros((2, 2, 2, 2, 8, 64), dtype=np.float16)
        with pytest.raises(InvalidArgument) as info:
            client.put(hashes[2:4], bad_shape)
        assert "[n, 2, 2, 2, 16, 64]" in info.value.message  # names the expected shape
        with pytest.raises(InvalidArgument, match="float16"):
            client.put(hashes[2:4], np.zeros((2, *SPEC.block_shape), dtype=np.float32))
        with pytest.raises(InvalidArgument, match="float16"):
            client.put(hashes[2:4], torch.zeros(2, *SPEC.block_shape, dtype=torch.bfloat16))
        with pytest.raises(InvalidArgument, match="3 hashes for 2 blocks"):
            client.put(hashes[2:5], make_blocks(2, seed=4))
        with pytest.raises(InvalidArgument, match=r"\[n, 2, 2, 2, 16, 64\]"):
            client.get_into(hashes[:2], np.zeros((2, 2, 2, 2, 16, 32), dtype=np.float16))
        with pytest.raises(InvalidArgument, match="out holds 1 blocks"):
            client.get_into(hashes[:2], np.zeros((1, *SPEC.block_shape), dtype=np.float16))
        after = stats(pool_daemon.address)
        for key in ("blocks", "used_bytes", "puts", "pending_puts", "leases_active"):
            assert after[key] == before[key], key
        assert client.get(hashes).tobytes() == blocks.tobytes()


def test_a_plain_list_is_a_typed_error(pool_daemon: DaemonHandle) -> None:
    with PoolClient.connect(pool_daemon.address, SPEC) as client, pytest.raises(InvalidArgument):
        client.put(client.hashes(TOKENS)[:1], [[0.0] * 4])


def test_unknown_namespace_is_a_typed_error_and_daemon_keeps_serving(pool_daemon: DaemonHandle) -> None:
    stranger = Namespace(SPEC, b"never-said-hello").digest()
    for method in ("Lookup", "Lease", "PutStart", "Remove"):
        err = expect_typed(pool_daemon.address, method, pool_pb2.HashesRequest(namespace=stranger, hashes=bytes(32)))
        assert isinstance(err, UnknownNamespace), method
        assert stranger.hex() in err.message and "Hello" in err.hint
    err = expect_typed(pool_daemon.address, "Snapshot", pool_pb2.SnapshotRequest(namespace=stranger))
    assert isinstance(err, UnknownNamespace)
    with PoolClient.connect(pool_daemon.address, SPEC) as client:
        hashes = client.hashes(TOKENS)
        assert client.put(hashes[:1], make_blocks(1, seed=5)).stored == 1
        assert client.lookup(hashes) == 1


def test_malformed_requests_are_invalid_argument_and_daemon_keeps_serving(pool_daemon: DaemonHandle) -> None:
    address = pool_daemon.address
    with PoolClient.connect(address, SPEC, salt=SALT) as client:
        hashes = client.hashes(TOKENS)
        blocks = make_blocks(2, seed=6)
        client.put(hashes[:2], blocks)
        ns = client.namespace.digest()
        for method in ("Lookup", "Lease", "PutStart", "Remove"):
            err = expect_typed(address, method, pool_pb2.HashesRequest(namespace=ns, hashes=b"\x01" * 17))
            assert isinstance(err, InvalidArgument), method
            assert "multiple of 16" in err.message
        err = expect_typed(address, "Pin", pool_pb2.PinRequest(namespace=ns, hashes=pack_hashes(hashes[:1])))
        assert isinstance(err, InvalidArgument) and "ttl_ms" in err.message  # soft pin without a TTL
        err = expect_typed(address, "PutCommit", pool_pb2.PutCommitRequest(put_id=987654, checksums=[1]))
        assert err.code.wire_name == "NOT_FOUND"
        # Hello with bad specs / versions
        good = hello_request(client.namespace)
        bad_spec = pool_pb2.HelloRequest()
        bad_spec.CopyFrom(good)
        bad_spec.spec.num_layers = 0
        assert isinstance(expect_typed(address, "Hello", bad_spec), InvalidArgument)
        wrong_digest = pool_pb2.HelloRequest()
        wrong_digest.CopyFrom(good)
        wrong_digest.spec.head_dim = 128  # spec no longer matches spec_digest
        assert isinstance(expect_typed(address, "Hello", wrong_digest), SpecMismatch)
        old_scheme = pool_pb2.HelloRequest()
        old_scheme.CopyFrom(good)
        old_scheme.hash_scheme = "kvpool-h0"
        err = expect_typed(address, "Hello", old_scheme)
        assert isinstance(err, VersionMismatch) and "kvpool-h0" in err.message
        old_proto = pool_pb2.HelloRequest()
        old_proto.CopyFrom(good)
        old_proto.protocol_version = "kvpool.v0"
        assert isinstance(expect_typed(address, "Hello", old_proto), InvalidArgument)
        short_ns = pool_pb2.HelloRequest()
        short_ns.CopyFrom(good)
        short_ns.namespace = b"short"
        assert isinstance(expect_typed(address, "Hello", short_ns), InvalidArgument)
        # same namespace digest, different spec: refused, the registered spec stays
        other = KVSpec(model="other", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
        hijack = hello_request(Namespace(other))
        hijack.namespace = ns
        assert isinstance(expect_typed(address, "Hello", hijack), SpecMismatch)
        # still serving, nothing changed
        assert client.lookup(hashes) == 2
        assert client.get(hashes).tobytes() == blocks.tobytes()
    assert pool_daemon.proc.poll() is None


def test_batch_over_the_daemon_limit_is_refused_client_side(daemon_factory: Any) -> None:
    daemon = daemon_factory("--max-batch-blocks", "4")
    with PoolClient.connect(daemon.address, SPEC) as client:
        assert client.max_batch_blocks == 4
        hashes = client.hashes(TOKENS)
        with pytest.raises(InvalidArgument, match="split"):
            client.lookup(hashes)
        err = expect_typed(
            daemon.address, "Lookup", pool_pb2.HashesRequest(namespace=client.namespace.digest(),
                                                             hashes=pack_hashes(hashes))
        )  # fmt: skip
        assert isinstance(err, InvalidArgument) and "split" in err.hint


def test_block_larger_than_a_slab_is_refused_at_hello(daemon_factory: Any) -> None:
    daemon = daemon_factory("--slab-bytes", "8KiB", capacity="1MiB")
    with pytest.raises(InvalidArgument, match="slab") as info:
        PoolClient.connect(daemon.address, SPEC)  # 16 KiB blocks
    assert "--slab-bytes" in info.value.hint


def test_put_over_capacity_is_capacity_exhausted_and_loses_nothing(daemon_factory: Any) -> None:
    daemon = daemon_factory("--slab-bytes", "256KiB", "--high-watermark", "1.0", "--low-watermark", "1.0",
                            capacity="1MiB")  # fmt: skip
    slots = (1 << 20) // SPEC.block_bytes  # 64 blocks of 16 KiB
    tokens = list(range(16 * (slots + 8)))
    with PoolClient.connect(daemon.address, SPEC) as client:
        hashes = client.hashes(tokens)
        with pytest.raises(CapacityExhausted) as info:
            client.put(hashes[: slots + 1], make_blocks(slots + 1, seed=7))  # can never fit
        assert info.value.hint
        assert stats(daemon.address)["blocks"] == 0 and stats(daemon.address)["used_bytes"] == 0
        blocks = make_blocks(slots, seed=8)
        assert client.put(hashes[:slots], blocks).stored == slots
        assert client.pin(hashes[:slots]) == slots  # hard pins: nothing is evictable
        with pytest.raises(CapacityExhausted):
            client.put(hashes[slots : slots + 2], make_blocks(2, seed=9))
        assert client.lookup(hashes) == slots
        assert client.get(hashes[:slots]).tobytes() == blocks.tobytes()
        s = stats(daemon.address)
        assert s["blocks"] == slots and s["pending_puts"] == 0 and s["evictions"] == 0
        assert client.unpin(hashes[:1]) == 1
        assert client.put(hashes[slots : slots + 1], make_blocks(1, seed=10)).stored == 1
        assert client.lookup(hashes[:1]) == 0 and client.lookup(hashes[1:slots]) == slots - 1


def test_daemon_down_is_unavailable_naming_the_address() -> None:
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(Unavailable) as info:
        PoolClient.connect(address, SPEC, timeout_s=3.0)
    assert address in info.value.message and address in info.value.hint


def test_daemon_dying_under_a_client_is_unavailable(daemon_factory: Any) -> None:
    daemon = daemon_factory()
    client = PoolClient.connect(daemon.address, SPEC, timeout_s=3.0)
    try:
        hashes = client.hashes(TOKENS)
        client.put(hashes[:1], make_blocks(1, seed=11))
        daemon.kill()
        with pytest.raises(Unavailable) as info:
            client.lookup(hashes)
        assert daemon.address in info.value.message
    finally:
        client.close()  # must not raise with the daemon gone


def _lease_offsets(address: str, namespace: Namespace, hashes: list[bytes]) -> list[int]:
    reply = raw_call(address, "Lease", pool_pb2.HashesRequest(namespace=namespace.digest(), hashes=pack_hashes(hashes)))
    raw_call(address, "Release", pool_pb2.ReleaseRequest(lease_ids=[reply.lease_id]))
    return list(reply.offsets)


def test_corrupted_block_is_a_miss_never_wrong_bytes(pool_daemon: DaemonHandle) -> None:
    blocks = make_blocks(4, seed=12)
    with PoolClient.connect(pool_daemon.address, SPEC, salt=SALT) as client:
        hashes = client.hashes(TOKENS)[:4]
        client.put(hashes, blocks)
        offsets = _lease_offsets(pool_daemon.address, client.namespace, hashes)
        writable_arena(client)[offsets[2] + 100] ^= 0x5A  # garbage in block 2, after commit
        got = client.get(hashes)
        assert got.shape[0] == 2  # blocks 0, 1 good; 2 fails its checksum; 3 is not trusted
        assert got.tobytes() == blocks[:2].tobytes()
        out = np.zeros((4, *SPEC.block_shape), dtype=np.float16)
        assert client.get_into(hashes, out) == 2
        assert client.get(hashes[3:]).tobytes() == blocks[3:].tobytes()  # an intact block is still served
        assert client.get(hashes[2:3]).shape[0] == 0
    with PoolClient.connect(pool_daemon.address, SPEC, salt=SALT) as reader:  # a fresh reader: same answer
        assert reader.get(hashes).shape[0] == 2


def test_checksum_mismatch_at_commit_is_never_served(pool_daemon: DaemonHandle) -> None:
    with PoolClient.connect(pool_daemon.address, SPEC) as client:
        hashes = client.hashes(TOKENS)[:2]
        ns = client.namespace.digest()
        request = pool_pb2.HashesRequest(namespace=ns, hashes=pack_hashes(hashes))
        start = raw_call(pool_daemon.address, "PutStart", request)
        assert list(start.indices) == [0, 1]
        blocks = make_blocks(2, seed=13).view(np.uint8).reshape(2, -1)
        arena = writable_arena(client)
        for off, row in zip(start.offsets, blocks, strict=True):
            arena[off : off + SPEC.block_bytes] = row
        done = raw_call(
            pool_daemon.address, "PutCommit",
            pool_pb2.PutCommitRequest(put_id=start.put_id, checksums=[checksum64(blocks[0]), 12345]),
        )  # fmt: skip
        # one block in N of a same-host put is re-checked at commit, all of it once one fails:
        # block 1 fails there, or is committed and fails its first read; never served, dropped
        assert done.committed + len(done.checksum_failed) == 2
        assert list(done.checksum_failed) in ([1], [])
        assert client.get(hashes).tobytes() == blocks[:1].tobytes()
        assert client.lookup(hashes) == 1
        assert stats(pool_daemon.address)["checksum_failures"] == 1
