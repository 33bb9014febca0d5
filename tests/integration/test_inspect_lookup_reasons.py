"""``kvpool inspect lookup`` explains what really happened, against real daemons: a block
damaged in its slab file on disk is a checksum failure *at tier disk* (not an eviction); a
block whose put has started and not committed is a put in flight (not "never stored"); and a
prompt whose blocks are all here but whose reader got nothing names the lease refusal it
actually had: CAPACITY_EXHAUSTED at max_leases (now, and as it happened), INVALID_ARGUMENT
past max_batch_blocks, TENANT_BUSY from per-tenant fairness, PERMISSION_DENIED for a
credential that may not use the namespace, NOT_PROMOTED for a disk block that the
namespace's quota kept out of host. A lease granted afterwards clears the record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import REPO_ROOT, start_daemon
from test_heal_counters import disk_entry, eventually

from kvpool import KVSpec, PoolClient
from kvpool.core.auth import token_sha256
from kvpool.core.hashing import pack_hashes
from kvpool.core.spec import Namespace
from kvpool.proto import pool_pb2, pool_pb2_grpc
from kvpool.rpc.auth import call_metadata

SPEC = KVSpec(model="why-miss", num_layers=1, num_kv_heads=1, head_dim=64, dtype="float32", block_tokens=16)
TOKEN_ADMIN = "kvp_reasons-admin-token"
TOKEN_A = "kvp_reasons-tenant-a"
TOKEN_B = "kvp_reasons-tenant-b"


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *SPEC.block_shape)).astype(np.float32)


def lookup(address: str, hashes: list[bytes], *extra: str, namespace: str = "") -> Any:
    args = ["--hashes", ",".join(h.hex() for h in hashes), "--address", address, *extra]
    if namespace:
        args += ["--namespace", namespace]
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "inspect", "lookup", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout) if "--json" in extra else done.stdout


def lease(address: str, namespace: bytes, hashes: list[bytes], token: str = "") -> grpc.StatusCode | int:
    """One raw Lease (not released): its lease id, or the status code it was refused with."""
    with grpc.insecure_channel(address) as channel:
        stub = pool_pb2_grpc.PoolStub(channel)
        request = pool_pb2.HashesRequest(namespace=namespace, hashes=pack_hashes(hashes))
        try:
            return int(stub.Lease(request, timeout=30, metadata=call_metadata(token)).lease_id)
        except grpc.RpcError as err:
            return err.code()


def disk_tier(disk_dir: Path) -> tuple[str, ...]:
    """Daemon flags of a 64 MiB disk tier in ``disk_dir`` (8 MiB slab files, 256 KiB host slabs)."""
    return ("--slab-bytes", "262144", "--disk-dir", str(disk_dir), "--disk-capacity-bytes", str(64 << 20),
            "--disk-slab-file-bytes", str(8 << 20))  # fmt: skip


@pytest.mark.timeout(180)
def test_a_block_damaged_on_disk_is_a_checksum_failure_at_tier_disk(tmp_path: Path) -> None:
    disk_dir = tmp_path / "disk"
    daemon = start_daemon(*disk_tier(disk_dir), capacity="1MiB")
    try:
        with PoolClient.connect(daemon.address, SPEC) as client:
            hashes = client.hashes(np.arange(200 * SPEC.block_tokens))
            data = blocks(200, seed=1)
            for start in range(0, 200, 50):  # 1 MiB of host: the first blocks go down to disk
                assert client.put(hashes[start : start + 50], data[start : start + 50]).stored == 50
            key = client.namespace.digest() + hashes[0]
            assert eventually(lambda: disk_entry(disk_dir, key) is not None)
            before = lookup(daemon.address, hashes[:2], "--json")
            assert before["blocks"][0]["status"] == "hit" and before["blocks"][0]["tier"] == "disk"
            f, offset = disk_entry(disk_dir, key) or (0, 0)
            with (disk_dir / "slabs" / f"slab-{f:05d}.kvd").open("r+b") as fh:  # the real file's bytes
                fh.seek(offset + 100)
                fh.write(b"\xde\xad\xbe\xef")
            assert client.get(hashes[:1]).shape[0] == 0  # its promotion fails the check: dropped
        report = lookup(daemon.address, hashes[:2], "--json")
        assert (report["stopped_at"], report["stop_reason"]) == (0, "checksum_failure")
        stop = report["blocks"][0]
        assert stop["tier"] == "disk" and "policy" not in stop and stop["age_ms"] >= 0
        text = lookup(daemon.address, hashes[:2])
        assert "the chain stops at block 0: failed its checksum on disk" in text
    finally:
        daemon.stop()
        daemon.cleanup()


def test_put_in_flight_max_leases_and_an_oversized_batch(tmp_path: Path) -> None:
    daemon = start_daemon("--max-leases", "1", "--max-batch-blocks", "8")
    try:
        with PoolClient.connect(daemon.address, SPEC) as client:
            hashes = client.hashes(list(range(16 * 4)))
            client.put(hashes[:2], blocks(2, seed=2))
            ns = client.namespace.digest()
            with grpc.insecure_channel(daemon.address) as channel:  # block 2: PutStart, no commit
                stub = pool_pb2_grpc.PoolStub(channel)
                start = stub.PutStart(pool_pb2.HashesRequest(namespace=ns, hashes=pack_hashes(hashes[2:3])), timeout=30)
            assert len(start.indices) == 1
            report = lookup(daemon.address, hashes, "--json")
            assert (report["stopped_at"], report["stop_reason"]) == (2, "put_in_flight")
            assert report["blocks"][2]["expires_in_ms"] > 0 and report["lease_refused"] is None
            assert "a put of it is in flight" in lookup(daemon.address, hashes)

            assert isinstance(lease(daemon.address, ns, hashes[:2]), int)  # held: the node is at max_leases
            now = lookup(daemon.address, hashes[:2], "--json")["lease_refused"]
            assert now["code"] == "CAPACITY_EXHAUSTED" and now["age_ms"] is None and "max_leases" in now["message"]
            assert lease(daemon.address, ns, hashes[:2]) == grpc.StatusCode.RESOURCE_EXHAUSTED
            had = lookup(daemon.address, hashes[:2], "--json")
            assert had["hit_blocks"] == 2 and had["lease_refused"]["code"] == "CAPACITY_EXHAUSTED"
            assert had["lease_refused"]["age_ms"] >= 0 and had["blocks"][0]["lease"] == "refused: CAPACITY_EXHAUSTED"
            assert "the latest lease was refused" in lookup(daemon.address, hashes[:2])

            too_many = hashes[:2] + [bytes([i]) * 16 for i in range(8)]
            assert lease(daemon.address, ns, too_many) == grpc.StatusCode.INVALID_ARGUMENT
            refused = lookup(daemon.address, hashes[:2], "--json")["lease_refused"]
            assert refused["code"] == "INVALID_ARGUMENT" and "the limit is 8" in refused["message"]
    finally:
        daemon.cleanup()


def test_tenant_busy_and_permission_denied_are_the_reasons_given(tmp_path: Path) -> None:
    ns_a, ns_b = Namespace(SPEC, salt=b"a").digest(), Namespace(SPEC, salt=b"b").digest()
    creds = tmp_path / "credentials.json"
    creds.write_text(json.dumps({
        "tenants": [
            {"name": "a", "token_sha256": token_sha256(TOKEN_A), "namespaces": [ns_a.hex()]},
            {"name": "b", "token_sha256": token_sha256(TOKEN_B), "namespaces": [ns_b.hex()]},
        ],
        "admins": [{"name": "ops", "token_sha256": token_sha256(TOKEN_ADMIN)}],
    }))  # fmt: skip
    # a budget of 8 units refilled at 1 a second: a 9-unit lease (8,192 hashes) owes 7 of them, so by the
    # third such lease the bucket is in debt for seconds and the next, waiting 50 ms, is refused TENANT_BUSY;
    # with no per-call cost, a one-unit call is never rate-limited, debt or not (the last lease below)
    daemon = start_daemon(
        "--credentials", str(creds), "--arena-handoff", "file", "--tenant-budget-units", "8",
        "--tenant-rate-units-per-s", "1", "--tenant-wait-ms", "50", "--tenant-call-cost-items", "0",
    )  # fmt: skip
    admin = ("--token", TOKEN_ADMIN, "--json")
    try:
        with PoolClient.connect(daemon.address, SPEC, salt=b"a", token=TOKEN_A) as client:
            hashes = client.hashes(list(range(16 * 2)))
            client.put(hashes, blocks(2, seed=3))
        bulk = hashes + [i.to_bytes(16, "little") for i in range(8192)]
        codes: list[grpc.StatusCode | int] = []
        while len(codes) < 6 and grpc.StatusCode.RESOURCE_EXHAUSTED not in codes:  # stop at the refusal
            codes.append(lease(daemon.address, ns_a, bulk, TOKEN_A))
        assert isinstance(codes[0], int) and codes[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED, codes
        busy = lookup(daemon.address, hashes, *admin, namespace=ns_a.hex())
        assert busy["hit_blocks"] == 2 and busy["lease_refused"]["code"] == "TENANT_BUSY"

        assert lease(daemon.address, ns_a, hashes, TOKEN_B) == grpc.StatusCode.PERMISSION_DENIED
        denied = lookup(daemon.address, hashes, *admin, namespace=ns_a.hex())["lease_refused"]
        assert denied["code"] == "PERMISSION_DENIED" and "'b' may not use namespace" in denied["message"]

        assert isinstance(lease(daemon.address, ns_a, hashes, TOKEN_A), int)  # one unit: never rate-limited
        assert lookup(daemon.address, hashes, *admin, namespace=ns_a.hex())["lease_refused"] is None
    finally:
        daemon.cleanup()


@pytest.mark.timeout(180)
def test_a_disk_block_the_quota_keeps_out_of_host_is_not_promoted(tmp_path: Path) -> None:
    block_bytes = SPEC.block_bytes
    daemon = start_daemon(*disk_tier(tmp_path / "disk"), "--namespace-quota-bytes", str(4 * block_bytes))
    try:
        with PoolClient.connect(daemon.address, SPEC) as client:
            hashes = client.hashes(list(range(16 * 8)))
            client.put(hashes[:4], blocks(4, seed=4))
            client.put(hashes[4:8], blocks(4, seed=5))  # past the quota: 0..3 go down to disk
            assert eventually(lambda: lookup(daemon.address, hashes[:1], "--json")["blocks"][0].get("tier") == "disk")
            assert client.pin(hashes[4:8]) == 4  # the namespace's host blocks cannot make room
            assert client.get(hashes[:1]).shape[0] == 0  # held on disk, but the read gets nothing
        report = lookup(daemon.address, hashes[:1], "--json")
        assert report["hit_blocks"] == 1 and report["blocks"][0]["tier"] == "disk"
        refused = report["lease_refused"]
        assert refused["code"] == "NOT_PROMOTED" and "quota" in refused["message"]
    finally:
        daemon.cleanup()


def test_lookup_of_text_through_a_tokenizer_saved_on_disk(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = [f"w{i}" for i in range(64)]
    model = tokenizers.models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]")
    inner = tokenizers.Tokenizer(model)
    inner.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    text = " ".join(words[:40])  # 40 tokens: 2 full blocks of 16 (the rest is never hashed)
    daemon = start_daemon()
    try:
        with PoolClient.connect(daemon.address, SPEC) as client:
            hashes = client.hashes(list(range(1, 41)))  # the word-level ids of w0..w39
            client.put(hashes[:1], blocks(1, seed=6))
        done = subprocess.run(
            [sys.executable, "-m", "kvpool.cli.main", "inspect", "lookup", "--text", text, "--tokenizer",
             str(tmp_path / "tok"), "--json", "--address", daemon.address],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert (report["blocks_total"], report["hit_blocks"], report["stop_reason"]) == (2, 1, "never_stored")
        assert report["blocks"][0]["hash"] == hashes[0].hex()
    finally:
        daemon.cleanup()
