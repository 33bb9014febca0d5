"""Cluster benchmark: node-to-node get throughput beside Mooncake Store and Redis, and
whole-prompt directory lookup latency, all measured in the same run on this machine.

    python tools/bench_cluster.py                    # re-executes itself inside `unshare -n`
    python tools/bench_cluster.py --no-netns --skip-mooncake

What is measured (median over --iters batches, after --warmup batches):
- kvpool: node A (a `kvpool serve` process) holds the blocks; this process is a
  ClusterClient attached to node B on another "host" (--host-name), so every block
  crosses the data plane from A's arena into our buffer, checksummed on arrival.
  "cluster get" = directory lookup + transfer + verify; "transport" = the data plane
  alone. For the tcp, ucx and nixl data planes (node A serves tcp and ucx; node N, started
  with --transport nixl, holds its own copy of the blocks for the nixl reader).
- loopback tcp bound: the same bytes sent by another process over one loopback TCP
  connection and received with nothing else (tools/bench_tcp_bound.py): the ceiling of
  any TCP reader here; "kvpool tcp ... / loopback tcp bound" is how much of it a read gets.
- Mooncake Store: a writer process puts the blocks into its own segment; this process
  reads them with `batch_get_into` and with a loop of `get_into` (protocol tcp) into a
  registered buffer: the two-process get.
- Redis: `redis-server` on 127.0.0.1; MGET (batch) and GET (loop), copied into the buffer.
- Cases: --blocks blocks of each --block-mib size, and a whole prompt of --prompt-blocks
  blocks of --prompt-block-kib (one batched request / NIXL READ per system).
- Directory lookup: 512 blocks spread over 3 nodes, one Lookup call for the whole prompt,
  paced (one every 20 ms) and back to back (held by the directory's per-tenant call rate).

Mooncake's master and transfer engine listen on every interface, so by default the
script runs inside a private network namespace (`unshare -n`, loopback only).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvpool.client.cluster_client import ClusterClient  # noqa: E402
from kvpool.core.spec import KVSpec  # noqa: E402
from kvpool.daemon.cluster_local import LocalCluster, free_port, wait_until  # noqa: E402
from kvpool.daemon.launcher import Proc  # noqa: E402
from kvpool.transport.base import ReadItem  # noqa: E402
from kvpool.transport.factory import make_transport, nixl_available, ucx_available  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pool import LOOKUP_PACE_MS, reserved_huge_pages, shmem_thp_on  # noqa: E402
from bench_tcp_bound import ROW as TCP_BOUND  # noqa: E402
from bench_tcp_bound import tcp_bound_batch  # noqa: E402

MiB = 1 << 20
#: the holders' arena kinds in batch names: 4 KiB pages, reserved huge pages, transparent huge pages
ARENA_SUFFIXES = ("", "/huge", "/thp")


TOKEN_KIB = 128  # 32 layers x 8 kv heads x 128 dims x k|v x bf16 = 128 KiB per token


def spec_for(block_kib: int) -> KVSpec:
    return KVSpec(
        model="bench",
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        block_tokens=block_kib // TOKEN_KIB,
    )


Batch = Callable[[], None]  # moves one batch into the reader's buffer; asserts it all arrived


def interleaved(batches: dict[str, Batch], iters: int, warmup: int) -> dict[str, list[float]]:
    """Time every system's batch round-robin, so a load spike on this shared machine hits
    all of them rather than whichever happened to run at that moment."""
    for _ in range(warmup):
        for fn in batches.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(iters):
        for name, fn in batches.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


# -- kvpool ------------------------------------------------------------------------------
@contextlib.contextmanager
def kvpool_batches(
    directory: str,
    a_addr: str,
    b_addr: str,
    block_kib: int,
    blocks: int,
    transports: list[str],
    suffix: str = "",
    one_stream: bool = False,
    per_item: bool = False,
    python_receive: bool = False,
) -> Iterator[tuple[dict[str, Batch], Callable[[], None]]]:
    """Blocks written to the node at ``a_addr``; readers attached to node B (another host name).
    ``suffix`` tells holders of another arena kind apart in the batch names ("/huge", "/thp");
    ``one_stream``: also a reader whose reads stay on one connection ("1 stream" rows);
    ``per_item``: also a UCX transport that moves one message per block ("per-item" row);
    ``python_receive``: also a TCP transport that receives with ``recv_into`` and hashes each
    block after it landed ("python-receive" row)."""
    spec = spec_for(block_kib)
    data = np.random.default_rng(block_kib).integers(0, 1 << 16, size=(blocks, *spec.block_shape), dtype=np.uint16)
    salt = a_addr.encode()  # each holder its own blocks: a reader cannot be served by the other holder
    with ClusterClient.connect(spec, salt=salt, directory=[directory], local=a_addr) as writer:
        hashes = writer.hashes(np.arange(blocks * spec.block_tokens) + block_kib * 100_000)
        writer.put(hashes, data)
        wait_until(lambda: writer.lookup(hashes) == blocks, 10, "blocks visible in the directory")
        holder = writer.locate(hashes[:1])[0][0][0]
        ns = writer.namespace.digest()
    out = np.empty_like(data)
    rows = out.reshape(-1).view(np.uint8).reshape(blocks, spec.block_bytes)
    items = [ReadItem(h) for h in hashes]
    batches: dict[str, Batch] = {}
    with contextlib.ExitStack() as stack:
        readers: list[ClusterClient] = []
        for kind, streams in [(kind, 0) for kind in transports] + [(kind, 1) for kind in transports if one_stream]:
            reader = stack.enter_context(
                ClusterClient.connect(
                    spec, salt=salt, directory=[directory], local=b_addr, transport=kind, read_streams=streams
                )
            )
            readers.append(reader)
            transport = make_transport(kind, streams=streams)
            stack.callback(transport.close)
            label = f"{kind}{suffix}" + (" 1 stream" if streams == 1 else "")

            def cluster_get(reader: ClusterClient = reader) -> None:
                got = reader.get_into(hashes, out)
                assert got == blocks, f"cluster get returned {got} of {blocks}"

            def raw_read(transport: Any = transport) -> None:
                got = transport.read(holder.data_address, ns, items, list(rows))
                assert got.ok == blocks, got.reason

            batches[f"kvpool {label} cluster get"] = cluster_get
            batches[f"kvpool {label} transport"] = raw_read
            # A/B rows: a variant of this kind's transport, timed beside the default one
            variants = {("ucx", "per-item"): per_item, ("tcp", "python-receive"): python_receive}
            for (variant_kind, variant), wanted in variants.items():
                if wanted and kind == variant_kind and streams == 0:
                    other = variant_transport(variant)
                    stack.callback(other.close)
                    batches[f"kvpool {label} {variant} transport"] = functools.partial(raw_read, other)

        def verify() -> None:
            assert np.array_equal(out, data)
            for reader in readers:  # every block crossed the data plane, none came from node B
                assert reader.counters["remote_blocks"] > 0 and reader.counters["local_blocks"] == 0

        yield batches, verify


def variant_transport(variant: str) -> Any:
    """The A/B transports: UCX moving one message per block (as before runs), and TCP
    receiving with ``recv_into`` and a checksum per block (as before the native receive)."""
    if variant == "per-item":
        from kvpool.transport.ucx import UcxTransport

        return UcxTransport(runs=False)
    from kvpool.transport.tcp import TcpTransport

    return TcpTransport(native_receive=False)


# -- Mooncake ----------------------------------------------------------------------------
MOONCAKE_READY = "mooncake-writer-ready"


def mooncake_store(segment_bytes: int, buffer_bytes: int) -> Any:
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # read by Mooncake's transfer engine at setup
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        "127.0.0.1", "http://127.0.0.1:8080/metadata", segment_bytes, buffer_bytes, "tcp", "", "127.0.0.1:50051"
    )
    if rc != 0:
        raise RuntimeError(f"Mooncake setup failed: {rc}")
    return store


def mooncake_writer(block_bytes: int, blocks: int, prefix: str, ready_path: str) -> None:
    """Runs in its own process: put the blocks into this process's segment, then wait."""
    store = mooncake_store(blocks * block_bytes + 256 * MiB, 64 * MiB)
    buf = np.random.default_rng(1).integers(0, 255, size=blocks * block_bytes, dtype=np.uint8)
    store.register_buffer(buf.ctypes.data, buf.nbytes)
    for i in range(blocks):
        rc = store.put_from(f"{prefix}{i}", buf.ctypes.data + i * block_bytes, block_bytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake put_from failed: {rc}")
    with open(ready_path, "w") as fh:
        fh.write("1")
    time.sleep(3600)


@contextlib.contextmanager
def mooncake_batches(
    block_kib: int, blocks: int, workdir: str
) -> Iterator[tuple[dict[str, Batch], Callable[[], None]]]:
    """A writer process puts the blocks into its own segment; this process reads them."""
    block_bytes = block_kib << 10
    prefix = f"b{block_kib}-"
    ready = os.path.join(workdir, f"{MOONCAKE_READY}-{block_kib}")
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    master = start_mooncake_master(workdir, block_kib)  # fresh per run: no segment of an earlier writer
    log_path = os.path.join(workdir, f"mooncake-writer-{block_kib}.log")
    with open(log_path, "wb") as log:
        writer = subprocess.Popen(
            [sys.executable, __file__, "--mooncake-writer", str(block_kib), str(blocks), prefix, ready],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    store = None
    try:
        try:
            wait_until(lambda: os.path.exists(ready), 60, "Mooncake writer", writer)
        except Exception:
            with open(log_path, "rb") as fh:
                print(fh.read()[-3000:].decode("utf-8", "replace"), file=sys.stderr)
            raise
        store = mooncake_store(0, blocks * block_bytes + 64 * MiB)
        buf = np.zeros(blocks * block_bytes, dtype=np.uint8)
        store.register_buffer(buf.ctypes.data, buf.nbytes)
        keys = [f"{prefix}{i}" for i in range(blocks)]
        ptrs = [buf.ctypes.data + i * block_bytes for i in range(blocks)]
        sizes = [block_bytes] * blocks

        def batch() -> None:
            rcs = store.batch_get_into(keys, ptrs, sizes)
            assert all(rc == block_bytes for rc in rcs), rcs[:4]

        def one_by_one() -> None:
            for key, ptr in zip(keys, ptrs):
                rc = store.get_into(key, ptr, block_bytes)
                assert rc == block_bytes, rc

        expected = np.random.default_rng(1).integers(0, 255, size=blocks * block_bytes, dtype=np.uint8)

        def verify() -> None:
            assert np.array_equal(buf, expected), "Mooncake returned other bytes than the writer put"

        yield {"mooncake batch_get_into": batch, "mooncake get_into": one_by_one}, verify
        store.unregister_buffer(buf.ctypes.data)
    finally:
        if store is not None:
            store.close()
        writer.kill()
        writer.wait()
        master.kill()
        master.wait()


def mooncake_master_path() -> str:
    """Where ``pip install mooncake-transfer-engine-non-cuda`` puts the master: beside this Python."""
    return os.path.join(os.path.dirname(sys.executable), "mooncake_master")


def mooncake_missing() -> str:
    """Why the Mooncake baseline cannot run here ("" when it can): the Python store, the native
    libraries it loads (Debian's libibverbs1 and librdmacm1) and the master binary."""
    master = mooncake_master_path()
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as exc:
        return f"{exc} (pip install -e '.[bench]'; apt-get install libibverbs1 librdmacm1)"
    if not os.access(master, os.X_OK):
        return f"{master} is missing (pip install -e '.[bench]')"
    return ""


def start_mooncake_master(workdir: str, tag: int) -> subprocess.Popen[bytes]:
    with open(os.path.join(workdir, f"mooncake-master-{tag}.log"), "wb") as log:
        master = subprocess.Popen(
            [
                mooncake_master_path(),
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    time.sleep(1.5)
    return master


# -- Redis -------------------------------------------------------------------------------
@contextlib.contextmanager
def redis_batches(block_kib: int, blocks: int, workdir: str) -> Iterator[tuple[dict[str, Batch], Callable[[], None]]]:
    import redis

    port = free_port()
    server = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
            "--proto-max-bulk-len",
            "1gb",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        wait_until(lambda: bool(client.ping()), 20, "redis-server", server)
        block_bytes = block_kib << 10
        data = np.random.default_rng(2).integers(0, 255, size=(blocks, block_bytes), dtype=np.uint8)
        keys = [f"b{block_kib}-{i}" for i in range(blocks)]
        for key, row in zip(keys, data):
            client.set(key, row.tobytes())
        out = np.empty_like(data)

        def mget() -> None:
            for i, value in enumerate(client.mget(keys)):
                out[i] = np.frombuffer(value, dtype=np.uint8)  # type: ignore[arg-type]

        def get() -> None:
            for i, key in enumerate(keys):
                out[i] = np.frombuffer(client.get(key), dtype=np.uint8)  # type: ignore[arg-type]

        def verify() -> None:
            assert np.array_equal(out, data)

        yield {"redis MGET": mget, "redis GET": get}, verify
        client.close()
    finally:
        server.kill()
        server.wait()


@contextlib.contextmanager
def tcp_bound_batches(block_kib: int, blocks: int) -> Iterator[tuple[dict[str, Batch], Callable[[], None]]]:
    """The same bytes over one loopback TCP connection and nothing else (tools/bench_tcp_bound.py)."""
    with tcp_bound_batch(block_kib << 10, blocks) as (receive, check):
        yield {TCP_BOUND: receive}, check


# -- directory lookup --------------------------------------------------------------------
def bench_lookup(cluster: LocalCluster, directory: str, node_addrs: list[str], samples: int) -> dict[str, float]:
    spec = KVSpec(model="bench-lookup", num_layers=2, num_kv_heads=1, head_dim=16, dtype="float16", block_tokens=16)
    blocks = 512
    rng = np.random.default_rng(3)
    data = rng.integers(0, 1 << 15, size=(blocks, *spec.block_shape)).astype(np.float16)
    with ClusterClient.connect(spec, directory=[directory], local=node_addrs[0]) as c:
        hashes = c.hashes(np.arange(blocks * spec.block_tokens))
        thirds = [(0, 171), (171, 342), (342, 512)]
        for (lo, hi), name in zip(thirds, ["node-a", "node-b", "node-c"]):
            c.put_on(name, hashes[lo:hi], data[lo:hi])
        wait_until(lambda: c.lookup(hashes) == blocks, 10, "512 blocks visible")
        holders = {h.node_id for hs in c.locate(hashes)[0] for h in hs}
        assert holders == {"node-a", "node-b", "node-c"}, holders
        back_to_back = interleaved({"lookup": lambda: c.locate(hashes) and None}, samples, 20)["lookup"]
        paced = []  # as bench_pool.py paces its lookups: back to back, the per-tenant call rate sets the pace
        for _ in range(samples):
            time.sleep(LOOKUP_PACE_MS / 1e3)
            t0 = time.perf_counter()
            c.locate(hashes)
            paced.append(time.perf_counter() - t0)
    report = {}
    for how, times in (("", paced), (" back to back", back_to_back)):
        times_ms = sorted(t * 1000 for t in times)
        report[f"lookup 512 blocks{how} median ms"] = statistics.median(times_ms)
        report[f"lookup 512 blocks{how} p99 ms"] = times_ms[int(0.99 * (len(times_ms) - 1))]
    return report


# -- driver ------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix="kvpool-bench-cluster-")
    report: dict[str, Any] = {
        "blocks_per_batch": args.blocks,
        "iters": args.iters,
        "results": {},
        "load_average_start": os.getloadavg(),  # the machine may be shared: say how loaded it was
    }
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    transports = ["tcp"] + (["ucx"] if not ucx_available() and not args.no_ucx else [])
    with_nixl = not nixl_available() and not args.no_nixl
    cases = [(mib << 10, args.blocks) for mib in args.block_mib] if args.blocks > 0 else []  # 0: the prompt alone
    if args.prompt_blocks:
        cases.append((args.prompt_block_kib, args.prompt_blocks))
    try:
        with contextlib.ExitStack() as stack_outer, LocalCluster(workdir) as cluster:
            directory = cluster.start_directory(etcd=False).address
            largest = max(kib * n for kib, n in cases) >> 10
            capacity_mib = max(largest * 2 + 64, 256)
            capacity = f"{capacity_mib}MiB"
            # (suffix, ucx/tcp holder, nixl holder): 4 KiB-page arenas, and with --arena-huge-pages
            # a second pair on reserved huge pages, measured interleaved in the same batches
            holders: list[tuple[str, Proc, Proc | None]] = []
            kinds: list[tuple[str, list[str]]] = [("", [])]
            if args.arena_huge_pages:  # the holders' arenas on reserved huge pages (root)
                if not stack_outer.enter_context(reserved_huge_pages(2 * capacity_mib * MiB)):
                    raise SystemExit(
                        "--arena-huge-pages: the huge pages could not be reserved (root is needed, and free "
                        "memory for them: see HugePages_Free in /proc/meminfo)"
                    )
                kinds.append(("/huge", ["--arena-huge-pages", "on"]))
            if args.arena_thp:  # and on transparent huge pages of shared memory (root sets shmem_enabled)
                kinds.append(("/thp", ["--arena-huge-pages", "thp"]))
            for suffix, extra in kinds:
                tag = suffix.replace("/", "-")
                # a holder takes its transparent huge pages at start and keeps them: shmem_enabled is
                # advise only while those start, so Mooncake's segments, made later, are on 4 KiB
                # pages like the other holders'
                with shmem_thp_on(True) if suffix == "/thp" else contextlib.nullcontext(True) as pages_ok:
                    if not pages_ok:
                        raise SystemExit(
                            "--arena-thp: shared memory gets no transparent huge pages here and shmem_enabled "
                            "could not be set (root is needed)"
                        )
                    a = cluster.start_node(
                        f"node-a{tag}",
                        [directory],
                        etcd=False,
                        capacity=capacity,
                        transport="ucx" if "ucx" in transports else "tcp",
                        extra=extra,
                    )
                    n = (
                        cluster.start_node(
                            f"node-n{tag}", [directory], etcd=False, capacity=capacity, transport="nixl", extra=extra
                        )
                        if with_nixl
                        else None
                    )
                holders.append((suffix, a, n))
            a = holders[0][1]
            b = cluster.start_node("node-b", [directory], etcd=False, capacity="256MiB")
            c = cluster.start_node("node-c", [directory], etcd=False, capacity="256MiB")
            for block_kib, blocks in cases:
                with contextlib.ExitStack() as stack:
                    batches: dict[str, Batch] = {}
                    checks: list[Callable[[], None]] = []
                    setups = []
                    for suffix, holder, nixl_holder in holders:
                        setups.append(
                            kvpool_batches(
                                directory,
                                holder.address,
                                b.address,
                                block_kib,
                                blocks,
                                transports,
                                suffix,
                                args.one_stream_rows,
                                args.ucx_per_item_rows,
                                args.tcp_python_receive_rows,
                            )
                        )
                        if nixl_holder is not None:
                            setups.append(
                                kvpool_batches(
                                    directory,
                                    nixl_holder.address,
                                    b.address,
                                    block_kib,
                                    blocks,
                                    ["nixl"],
                                    suffix,
                                    args.one_stream_rows,
                                )
                            )
                    setups.append(tcp_bound_batches(block_kib, blocks))
                    if not args.skip_mooncake:
                        setups.append(mooncake_batches(block_kib, blocks, workdir))
                    if not args.skip_redis and shutil.which("redis-server") and importlib.util.find_spec("redis"):
                        setups.append(redis_batches(block_kib, blocks, workdir))
                    for setup in setups:
                        fns, check = stack.enter_context(setup)
                        batches.update(fns)
                        checks.append(check)
                    times = interleaved(batches, args.iters, args.warmup)
                    for check in checks:
                        check()
                nbytes = blocks * (block_kib << 10)
                row = {name: gbps(nbytes, t) for name, t in times.items()}
                label = f"{blocks} x {block_kib} KiB blocks"
                report["results"][label] = row
                print_row(label, row)
            report["load_average_end"] = os.getloadavg()
            print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            report["lookup"] = bench_lookup(cluster, directory, [a.address, b.address, c.address], args.lookups)
            print(json.dumps(report["lookup"]))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return report


def print_row(label: str, row: dict[str, float]) -> None:
    print(f"\n{label}, GB/s (median)")
    for name, value in row.items():
        print(f"  {name:32s} {value:7.2f}")
    for mine in [k for k in row if k.startswith("kvpool")]:
        for base in ("mooncake batch_get_into", "mooncake get_into", "redis MGET", "redis GET", TCP_BOUND):
            if base in row:
                print(f"  ratio {mine} / {base:24s} {row[mine] / row[base]:6.2f}x")
    for variant in ("per-item", "python-receive"):  # --ucx-per-item-rows, --tcp-python-receive-rows: A/Bs
        for one in [k for k in row if f" {variant} " in k]:
            default = one.replace(f" {variant}", "")
            if default in row:
                print(f"  ratio {default} / {variant} {row[default] / row[one]:6.2f}x")
    for one in [k for k in row if " 1 stream " in k]:  # --one-stream-rows: the multi-stream A/B
        many = one.replace(" 1 stream", "")
        if many in row:
            print(f"  ratio {many} / 1 stream {row[many] / row[one]:6.2f}x")

    def kind(name: str) -> str:
        return next((suffix for suffix in ARENA_SUFFIXES if suffix and suffix in name), "")

    for suffix in ARENA_SUFFIXES:  # the issue-17 target: nixl vs the fastest other kvpool, per arena kind
        for level in ("cluster get", "transport"):
            nixl = row.get(f"kvpool nixl{suffix} {level}")
            others = {
                k: v
                for k, v in row.items()
                if k.startswith("kvpool") and k.endswith(level) and "nixl" not in k and kind(k) == suffix
            }
            if nixl is not None and others:
                best = max(others, key=lambda k: others[k])
                print(f"  ratio kvpool nixl{suffix} {level} / {best:24s} {nixl / others[best]:6.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-mib", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    parser.add_argument("--blocks", type=int, default=32, help="blocks per batch (0: only the whole-prompt case)")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lookups", type=int, default=300)
    parser.add_argument("--skip-mooncake", action="store_true")
    parser.add_argument("--skip-redis", action="store_true")
    parser.add_argument("--no-ucx", action="store_true")
    parser.add_argument("--no-nixl", action="store_true")
    parser.add_argument("--prompt-blocks", type=int, default=512, help="a whole prompt in one batch (0 = skip)")
    parser.add_argument("--prompt-block-kib", type=int, default=256, help="its block size (2 tokens x 128 KiB)")
    parser.add_argument("--no-netns", action="store_true", help="do not re-execute inside `unshare -n`")
    parser.add_argument(
        "--arena-huge-pages",
        action="store_true",
        help="start the holder nodes with --arena-huge-pages on (reserves the huge pages: root); "
        "Mooncake's segments stay as Mooncake allocates them",
    )
    parser.add_argument(
        "--arena-thp",
        action="store_true",
        help="also start holder nodes with --arena-huge-pages thp (transparent huge pages of shared memory; as "
        "root this tool sets shmem_enabled to advise while they start and restores it), measured interleaved "
        "like --arena-huge-pages",
    )
    parser.add_argument(
        "--one-stream-rows",
        action="store_true",
        help="also time readers that keep each read on one connection (read_streams=1), interleaved "
        "with the default ones (ucx / nixl: one stream per core, at most 4; tcp: 1 already, so its "
        "'1 stream' rows repeat the default and show the spread of identical readers): the multi-stream A/B",
    )
    parser.add_argument(
        "--ucx-per-item-rows",
        action="store_true",
        help="also time a UCX transport that moves one message per block (READ_UCX) interleaved with the "
        "default one (blocks end to end on both sides moved as one message): the runs A/B",
    )
    parser.add_argument(
        "--tcp-python-receive-rows",
        action="store_true",
        help="also time a TCP transport that receives each block with recv_into and hashes it after it "
        "landed (TcpTransport(native_receive=False)), interleaved with the default one (received and "
        "hashed piece by piece in C, without the GIL): the receive A/B",
    )
    parser.add_argument("--json", default="", help="also write the report here")
    parser.add_argument("--mooncake-writer", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mooncake_writer:
        block_kib, blocks, prefix, ready = args.mooncake_writer
        mooncake_writer(int(block_kib) << 10, int(blocks), prefix, ready)
        return 0
    missing = "" if args.skip_mooncake else mooncake_missing()
    if missing:
        parser.error(f"the Mooncake baseline cannot run here: {missing}; or pass --skip-mooncake")
    if not args.no_netns and os.environ.get("KVPOOL_BENCH_NETNS") != "1":
        inner = " ".join([sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])])
        env = {**os.environ, "KVPOOL_BENCH_NETNS": "1"}
        proc = subprocess.Popen(["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {inner}"], env=env)
        signal.signal(signal.SIGTERM, lambda *_: proc.terminate())  # the inner run stops its cluster
        return proc.wait()
    # SIGTERM unwinds like Ctrl-C, so the cluster's processes are stopped, not left running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    report = run(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
