"""``kvpool inspect`` as a user runs it: every subcommand a subprocess against a real daemon
(and a real 3-node cluster), its ``--json`` parsed and checked against what the test stored,
including lookups that explain an eviction, a checksum failure, a removal, another namespace
and a block never stored; bad input gives one line, a non-zero exit and no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import REPO_ROOT, DaemonHandle, free_port, start_daemon, writable_arena

from kvpool import KVSpec, PoolClient
from kvpool.core.auth import token_sha256
from kvpool.core.hashing import pack_hashes
from kvpool.core.spec import Namespace
from kvpool.proto import pool_pb2, pool_pb2_grpc

SPEC = KVSpec(model="tiny-llama", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
TOKENS = list(range(9000, 9000 + 16 * 6))  # 6 full blocks


def make_blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**16, size=(n, *SPEC.block_shape), dtype=np.uint16).view(np.float16)


def inspect(
    *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "inspect", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, input=stdin, env=full_env,
    )  # fmt: skip


def inspect_json(*args: str, stdin: str | None = None) -> Any:
    done = inspect(*args, "--json", stdin=stdin)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def one_clear_line(done: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def tokens_file(tmp_path: Path, tokens: list[int]) -> str:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(tokens))
    return str(path)


def test_views_stats_tiers_namespaces_nodes_blocks_hot(pool_daemon: DaemonHandle) -> None:
    a = ("--address", pool_daemon.address)
    with PoolClient.connect(pool_daemon.address, SPEC) as client:
        hashes = client.hashes(TOKENS)
        client.put(hashes[:4], make_blocks(4, seed=1))
        for _ in range(3):
            assert client.get(hashes[:2]).shape[0] == 2
        client.get(hashes[:4])
        digest = client.namespace.digest().hex()
    stats = inspect_json("stats", *a)
    assert stats["blocks"] == 4 and stats["puts"] == 4
    tiers = inspect_json("tiers", *a)
    assert tiers["host"]["blocks"] == 4 and tiers["host"]["policy"] == "lru"
    namespaces = inspect_json("namespaces", *a)
    assert [ns["digest"] for ns in namespaces] == [digest] and namespaces[0]["used_bytes"] == 4 * SPEC.block_bytes
    nodes = inspect_json("nodes", *a)
    assert len(nodes) == 1 and nodes[0]["blocks"] == 4 and nodes[0]["live"] == "yes" and nodes[0]["tiers"] == ["host"]
    blocks = inspect_json("blocks", *a, "--limit", "2")
    assert blocks["total"] == 4 and len(blocks["hashes"]) == 2
    assert set(blocks["hashes"]) <= {h.hex() for h in hashes[:4]}
    hot = inspect_json("hot", *a, "--limit", "3")
    reads = {b["hash"]: b["reads"] for b in hot["blocks"]}
    assert reads[hashes[0].hex()] == 4 and reads[hashes[1].hex()] == 4 and reads.get(hashes[2].hex(), 0) <= 1
    assert hot["prefixes"][0] == {"namespace": digest, "first_hash": hashes[0].hex(), "reads": 4, "longest_blocks": 4}
    human = inspect("tiers", *a)
    assert human.returncode == 0 and "host" in human.stdout and "evictions" in human.stdout


def test_events_prints_the_last_n_with_hashes_and_tier_then_exits(pool_daemon: DaemonHandle) -> None:
    a = ("--address", pool_daemon.address)
    with PoolClient.connect(pool_daemon.address, SPEC) as client:
        hashes = client.hashes(TOKENS)
        for i in range(3):
            client.put(hashes[i : i + 1], make_blocks(1, seed=i))
        client.remove(hashes[:1])
    events = inspect_json("events", "--count", "2", *a)  # returns: does not follow
    assert [(e["seq"], e["kind"], e["tier"], e["hashes"]) for e in events] == [
        (3, "stored", "host", [hashes[2].hex()]),
        (4, "removed", "host", [hashes[0].hex()]),
    ]
    assert len(inspect_json("events", "--count", "50", *a)) == 4
    human = inspect("events", "--count", "1", *a)
    assert human.returncode == 0 and "removed" in human.stdout and hashes[0].hex()[:12] in human.stdout


@pytest.mark.timeout(90)
def test_events_follow_prints_new_events_as_they_come(pool_daemon: DaemonHandle) -> None:
    with PoolClient.connect(pool_daemon.address, SPEC) as client:
        hashes = client.hashes(TOKENS)
        client.put(hashes[:1], make_blocks(1, seed=5))
        follower = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", "inspect", "events", "--count", "1", "--follow", "--json",
             "--address", pool_daemon.address],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert follower.stdout is not None
            first = json.loads(follower.stdout.readline())  # the last one kept, one JSON line per event
            assert (first["seq"], first["hashes"]) == (1, [hashes[0].hex()])
            client.put(hashes[1:3], make_blocks(2, seed=6))
            event = json.loads(follower.stdout.readline())
            assert event["seq"] == 2 and event["kind"] == "stored" and event["tier"] == "host"
            assert event["hashes"] == [h.hex() for h in hashes[1:3]]
            assert follower.poll() is None  # still following
        finally:
            follower.terminate()
            follower.wait(10)


def test_lookup_explains_an_eviction_by_its_policy(tmp_path: Path) -> None:
    daemon = start_daemon("--slab-bytes", "1MiB", capacity="1MiB")
    try:
        with PoolClient.connect(daemon.address, SPEC) as client:
            n = (1 << 20) // SPEC.block_bytes + 3  # more than fit: the oldest go
            tokens = list(range(16 * n))
            hashes = client.hashes(tokens)
            for i in range(n):
                client.put(hashes[i : i + 1], make_blocks(1, seed=i))
        report = inspect_json("lookup", "--tokens", tokens_file(tmp_path, tokens), "--address", daemon.address)
    finally:
        daemon.cleanup()
    assert report["blocks_total"] == n and report["hit_blocks"] == 0 and report["stopped_at"] == 0
    stop = report["blocks"][0]
    assert stop["status"] == "miss" and stop["reason"] == "evicted"
    assert stop["tier"] == "host" and stop["policy"] == "lru" and stop["age_ms"] >= 0
    assert report["blocks"][-1]["status"] == "hit" and report["blocks"][-1]["tier"] == "host"


def test_lookup_explains_a_checksum_failure_a_removal_and_never_stored(
    pool_daemon: DaemonHandle, tmp_path: Path
) -> None:
    a = ("--address", pool_daemon.address)
    with PoolClient.connect(pool_daemon.address, SPEC) as client:
        hashes = client.hashes(TOKENS)
        client.put(hashes[:4], make_blocks(4, seed=2))
        with grpc.insecure_channel(pool_daemon.address) as channel:
            stub = pool_pb2_grpc.PoolStub(channel)
            request = pool_pb2.HashesRequest(namespace=client.namespace.digest(), hashes=pack_hashes(hashes[:4]))
            lease = stub.Lease(request, timeout=10)
            stub.Release(pool_pb2.ReleaseRequest(lease_ids=[lease.lease_id]), timeout=10)
        writable_arena(client)[lease.offsets[2] + 5] ^= 0x41  # block 2 rots after commit
        assert client.get(hashes[:4]).shape[0] == 2  # the reader sees it, reports it, it is dropped
        client.remove(hashes[3:4])
    report = inspect_json("lookup", "--tokens", tokens_file(tmp_path, TOKENS), *a)
    assert (report["hit_blocks"], report["stopped_at"], report["stop_reason"]) == (2, 2, "checksum_failure")
    rows = report["blocks"]
    assert [r["status"] for r in rows] == ["hit", "hit", "miss", "miss", "miss", "miss"]
    assert rows[2]["tier"] == "host" and rows[3]["reason"] == "removed"
    assert "reason" not in rows[4]  # beyond the stop, a block with no history is just a miss
    fresh = inspect_json("lookup", "--tokens", "-", *a, stdin=" ".join(str(t) for t in range(1, 40)))
    assert fresh["stop_reason"] == "never_stored" and fresh["blocks_total"] == 2
    human = inspect("lookup", "--tokens", tokens_file(tmp_path, TOKENS), *a)
    assert human.returncode == 0 and "the chain stops at block 2: failed its checksum on host" in human.stdout


def test_lookup_in_another_namespace_says_so(pool_daemon: DaemonHandle, tmp_path: Path) -> None:
    with PoolClient.connect(pool_daemon.address, SPEC, salt=b"tenant-a") as a, \
            PoolClient.connect(pool_daemon.address, SPEC, salt=b"tenant-b") as b:  # fmt: skip
        hashes = a.hashes(TOKENS)
        a.put(hashes[:2], make_blocks(2, seed=3))
        b_digest, a_digest = b.namespace.digest().hex(), a.namespace.digest().hex()
    report = inspect_json(
        "lookup", "--hashes", ",".join(h.hex() for h in hashes[:2]), "--namespace", b_digest[:10],
        "--address", pool_daemon.address,
    )  # fmt: skip
    assert report["namespace"] == b_digest and report["stop_reason"] == "other_namespace"
    assert report["blocks"][0]["namespaces"] == [a_digest]


def test_pin_unpin_evict_and_clear(pool_daemon: DaemonHandle, tmp_path: Path) -> None:
    a = ("--address", pool_daemon.address)
    tokens = tokens_file(tmp_path, TOKENS)
    with PoolClient.connect(pool_daemon.address, SPEC) as client:
        hashes = client.hashes(TOKENS)
        client.put(hashes, make_blocks(6, seed=4))
    assert inspect_json("pin", "--tokens", tokens, *a)["changed"] == 6
    pinned = inspect_json("lookup", "--tokens", tokens, *a)["blocks"]
    assert all(row["hard_pin"] for row in pinned)
    assert inspect_json("unpin", "--hashes", hashes[0].hex(), *a)["changed"] == 1
    assert inspect_json("pin", "--hashes", hashes[0].hex(), "--ttl-ms", "60000", *a)["changed"] == 1
    assert inspect_json("evict", "--hashes", f"{hashes[4].hex()},{hashes[5].hex()}", *a)["changed"] == 2
    report = inspect_json("lookup", "--tokens", tokens, *a)
    assert report["hit_blocks"] == 4 and report["stop_reason"] == "removed"
    refused = inspect("clear", *a)  # not a terminal: it cannot ask, so it refuses
    one_clear_line(refused, 2, "remove 4 blocks of 1 namespaces", "--yes")
    assert inspect_json("stats", *a)["blocks"] == 4
    cleared = inspect_json("clear", "--yes", *a)
    assert cleared == {"action": "cleared", "namespaces": 1, "blocks": 4, "removed": 4}
    assert inspect_json("stats", *a)["blocks"] == 0


def test_bad_input_is_one_line_and_a_non_zero_exit(pool_daemon: DaemonHandle, tmp_path: Path) -> None:
    a = ("--address", pool_daemon.address)
    dead = f"127.0.0.1:{free_port()}"
    one_clear_line(inspect("stats", "--address", dead), 1, dead, "UNAVAILABLE")
    one_clear_line(inspect("events", "--address", dead), 1, dead)
    one_clear_line(inspect("nodes", "--directory", dead), 1, f"the kvpool directory at {dead}", "kvpool directory")
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2 three")
    with PoolClient.connect(pool_daemon.address, SPEC) as client:
        client.put(client.hashes(TOKENS)[:1], make_blocks(1, seed=6))
    one_clear_line(inspect("lookup", "--tokens", str(bad), *a), 2, str(bad), "integers")
    one_clear_line(inspect("lookup", "--tokens", str(tmp_path / "missing.json"), *a), 2, "cannot read token ids")
    one_clear_line(inspect("lookup", "--tokens", "-", "--namespace", "ffff", *a, stdin="1 2"), 1, "no namespace 'ffff'")
    one_clear_line(inspect("lookup", *a), 2, "exactly one of --tokens")
    one_clear_line(inspect("lookup", "--text", "hello", *a), 2, "--tokenizer")
    one_clear_line(inspect("evict", "--hashes", "zz", *a), 2, "--hashes")
    one_clear_line(inspect("pin", "--hashes", "00" * 16, "--ttl-ms", "0", *a), 2, "--ttl-ms")
    one_clear_line(inspect("hot", "--limit", "-5", *a), 2, "--limit must be >= 0")
    one_clear_line(inspect("blocks", "--limit", "-1", *a), 2, "--limit must be >= 0")
    one_clear_line(inspect("hitrate", "--plot", str(tmp_path), *a), 2, "is a directory")
    one_clear_line(inspect("hitrate", "--plot", str(tmp_path / "no" / "x.png"), *a), 2, "no directory")


TOKEN_ADMIN = "kvp_inspect-admin-token"
TOKEN_TENANT = "kvp_inspect-tenant-token"


def test_admin_commands_need_the_admin_credential(tmp_path: Path) -> None:
    ns = Namespace(SPEC, salt=b"t").digest()
    creds = tmp_path / "credentials.json"
    creds.write_text(json.dumps({
        "tenants": [{"name": "t", "token_sha256": token_sha256(TOKEN_TENANT), "namespaces": [ns.hex()]}],
        "admins": [{"name": "ops", "token_sha256": token_sha256(TOKEN_ADMIN)}],
    }))  # fmt: skip
    daemon = start_daemon("--credentials", str(creds), "--arena-handoff", "file")
    try:
        with PoolClient.connect(daemon.address, SPEC, salt=b"t", token=TOKEN_TENANT) as client:
            hashes = client.hashes(TOKENS)
            client.put(hashes[:2], make_blocks(2, seed=7))
        a = ("--address", daemon.address)
        one_clear_line(inspect("clear", "--yes", *a), 1, "UNAUTHENTICATED")
        one_clear_line(
            inspect("evict", "--hashes", hashes[0].hex(), "--token", TOKEN_TENANT, *a), 1, "PERMISSION_DENIED", "admin"
        )
        one_clear_line(inspect("hot", "--token", TOKEN_TENANT, *a), 1, "PERMISSION_DENIED")
        evicted = inspect("evict", "--hashes", hashes[0].hex(), "--token", TOKEN_ADMIN, "--json", *a)
        assert evicted.returncode == 0 and json.loads(evicted.stdout)["changed"] == 1
        env = {"KVPOOL_TOKEN": TOKEN_ADMIN}
        done = inspect("lookup", "--hashes", hashes[1].hex(), "--json", *a, env=env)
        assert done.returncode == 0 and json.loads(done.stdout)["hit_blocks"] == 1
    finally:
        daemon.cleanup()


def test_doctor_checks_and_says_what_to_fix(pool_daemon: DaemonHandle, tmp_path: Path) -> None:
    checks = {c["name"]: c for c in inspect_json("doctor", "--address", pool_daemon.address)}
    assert checks["daemon"]["status"] == "ok" and pool_daemon.address in checks["daemon"]["detail"]
    assert checks["config"]["status"] == "ok" and checks["etcd"]["status"] == "skip"
    assert {"arena", "memory", "disk tier", "ucx", "nixl"} <= set(checks)
    assert checks["local calls"]["status"] == "ok" and pool_daemon.arena_dir in checks["local calls"]["detail"]
    config = tmp_path / "kvpool.toml"
    config.write_text(
        f'arena_dir = "{tmp_path / "nope"}"\n[store]\ncapacity_bytes = "64MiB"\n'
        f'[cluster]\netcd = "127.0.0.1:{free_port()}"\n'
    )
    done = inspect("doctor", "--config", str(config), "--json", "--address", f"127.0.0.1:{free_port()}")
    assert done.returncode == 1, done.stderr
    failed = {c["name"]: c for c in json.loads(done.stdout) if c["status"] == "fail"}
    assert set(failed) == {"daemon", "arena", "etcd"}
    assert "mkdir" in failed["arena"]["fix"] and failed["daemon"]["fix"]
    broken = tmp_path / "broken.toml"
    broken.write_text("capacity_bytes = 1\n")
    done = inspect("doctor", "--config", str(broken), "--json", "--address", pool_daemon.address)
    config_check = next(c for c in json.loads(done.stdout) if c["name"] == "config")
    assert done.returncode == 1 and config_check["status"] == "fail" and "capacity_bytes" in config_check["detail"]


def test_cluster_nodes_and_a_lookup_across_three_nodes(three_nodes: Any, tmp_path: Path) -> None:
    directory, (a, b, c) = three_nodes
    with PoolClient.connect(a, SPEC) as on_a, PoolClient.connect(b, SPEC) as on_b, PoolClient.connect(c, SPEC):
        hashes = on_a.hashes(TOKENS)
        on_a.put(hashes[:3], make_blocks(3, seed=8))
        on_b.put(hashes[1:5], make_blocks(4, seed=9))
        on_a.remove(hashes[2:3])
        on_b.remove(hashes[2:3])
    nodes = inspect_json("nodes", "--directory", directory)
    assert sorted(n["node_id"] for n in nodes) == ["node-a", "node-b", "node-c"]
    assert {n["node_id"]: n["blocks"] for n in nodes} == {"node-a": 2, "node-b": 3, "node-c": 0}
    assert all(n["live"] == "yes" for n in nodes)
    report = inspect_json("lookup", "--tokens", tokens_file(tmp_path, TOKENS), "--directory", directory)
    assert report["nodes"] == ["node-a", "node-b", "node-c"] and report["skipped"] == {}
    rows = report["blocks"]
    assert rows[0]["nodes"] == ["node-a"] and rows[1]["nodes"] == ["node-a", "node-b"] and rows[1]["tier"] == "host"
    assert report["stopped_at"] == 2 and report["stop_reason"] == "removed"
    assert set(rows[2]["per_node"]) == {"node-a", "node-b", "node-c"}
    assert rows[2]["per_node"]["node-c"]["reason"] == "never_stored"
    assert rows[3]["nodes"] == ["node-b"]  # held past the stop: listed, but a prefix cache cannot use it


def test_hitrate_samples_intervals_and_draws_them(pool_daemon: DaemonHandle, tmp_path: Path) -> None:
    png = tmp_path / "hitrate.png"
    with PoolClient.connect(pool_daemon.address, SPEC) as client:
        hashes = client.hashes(TOKENS)
        client.put(hashes[:3], make_blocks(3, seed=10))
        sampler = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", "inspect", "hitrate", "--samples", "3", "--interval-s", "0.3",
             "--plot", str(png), "--json", "--address", pool_daemon.address],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        lookups = 0
        while sampler.poll() is None:  # lookups of 6 blocks, 3 of them held, while it samples
            assert client.lookup(hashes) == 3
            lookups += 1
        out, err = sampler.communicate(timeout=30)
    assert sampler.returncode == 0, err
    samples = json.loads(out)
    assert len(samples) == 3
    looked = sum(s["looked_up_blocks"] for s in samples)
    assert 0 < looked <= 6 * lookups and looked % 6 == 0
    for s in samples:
        if s["looked_up_blocks"]:
            assert s["hit_rate"] == 0.5 and s["hit_rate_by_tier"]["host"] == 0.5
            assert s["hit_blocks"] == {"host": s["looked_up_blocks"] // 2, "device": 0, "disk": 0}
        else:
            assert s["hit_rate"] is None  # no lookups: no rate, not 0% or 100%
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
