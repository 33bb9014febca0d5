"""Benchmark: what TLS costs the TCP data plane (``--data-tls``), plaintext vs TLS in one run.

    python tools/bench_data_tls.py [--blocks 64] [--block-kib 512] [--iters 20] [--json out.json]

Two daemons with the same credentials, one plain and one ``--data-tls`` (a self-signed
certificate made with ``openssl``), each holding the same ``--blocks`` blocks. This process
reads them all over each data plane with one ``TcpTransport`` (a ticket from the node's
control plane; every block checksummed on arrival), alternating plain and TLS batches so
both see the same background load, and reports the median GB/s of each and the first-read
cost (connect + TLS handshake + AUTH). Needs the ``openssl`` CLI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import grpc
import numpy as np

from kvpool import KVSpec, PoolClient
from kvpool.client.tickets import StaticTickets
from kvpool.core.auth import new_token, token_sha256
from kvpool.daemon.cluster_local import free_port
from kvpool.proto import pool_pb2, pool_pb2_grpc
from kvpool.transport.base import ReadItem
from kvpool.transport.tcp import TcpTransport


def start(creds: str, token: str, tls: list[str], root: bytes | None) -> tuple[Any, str, str]:
    address, data = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "kvpool.cli.main", "serve", "--listen", address, "--data-listen", data]
    argv += ["--capacity-bytes", "512MiB", "--credentials", creds, "--log-level", "WARNING", *tls]
    proc = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    creds_rpc = grpc.ssl_channel_credentials(root) if root else None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            channel = grpc.secure_channel(address, creds_rpc) if creds_rpc else grpc.insecure_channel(address)
            with channel:
                pool_pb2_grpc.PoolStub(channel).Stats(
                    pool_pb2.StatsRequest(), timeout=1, metadata=(("authorization", f"Bearer {token}"),)
                )
            return proc, address, data
        except grpc.RpcError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("daemon did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-kib", type=int, default=512)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    head_dim = 64
    tokens = args.block_kib * 1024 // (2 * 2 * 2 * head_dim * 2)  # layers x k|v x heads x dim x fp16
    spec = KVSpec(model="bench", num_layers=2, num_kv_heads=2, head_dim=head_dim, dtype="float16", block_tokens=tokens)
    workdir = tempfile.mkdtemp(prefix="kvpool-bench-tls-")
    cert, key = os.path.join(workdir, "cert.pem"), os.path.join(workdir, "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=bench",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
        check=True, capture_output=True,
    )  # fmt: skip
    with open(cert, "rb") as fh:
        root = fh.read()
    token = new_token()
    creds = os.path.join(workdir, "credentials.json")
    with open(creds, "w") as fh:
        json.dump({"admins": [{"name": "bench", "token_sha256": token_sha256(token)}]}, fh)
    tls_args = ["--tls-cert-file", cert, "--tls-key-file", key]
    daemons = {
        "plain": start(creds, token, [], None),
        "tls": start(creds, token, [*tls_args, "--data-tls"], root),
    }
    blocks = np.random.default_rng(0).integers(0, 1 << 15, size=(args.blocks, *spec.block_shape)).astype(np.float16)
    transports: dict[str, TcpTransport] = {}
    hashes: list[bytes] = []
    first_ms: dict[str, float] = {}
    try:
        for name, (_, address, _) in daemons.items():
            with PoolClient.connect(
                address, spec, salt=b"b", token=token, tls_root_certs=root if name == "tls" else None
            ) as client:
                hashes = client.hashes(np.arange(tokens * args.blocks))
                assert client.put(hashes, blocks).stored == args.blocks
                transport = TcpTransport(timeout_s=30.0)
                transport.use_tickets(StaticTickets(client.data_ticket))
                transport.use_tls(root if name == "tls" else None)
                transports[name] = transport
                ns = client.namespace.digest()
        dst = np.zeros((args.blocks, spec.block_bytes), dtype=np.uint8)
        rates: dict[str, list[float]] = {name: [] for name in daemons}
        for i in range(args.iters + 1):
            for name, (_, _, data) in daemons.items():
                start_s = time.perf_counter()
                result = transports[name].read(data, ns, [ReadItem(h) for h in hashes], list(dst))
                took = time.perf_counter() - start_s
                assert result.ok == args.blocks, result.reason
                if i == 0:
                    first_ms[name] = round(took * 1e3, 2)  # connect, handshake, AUTH, then the read
                else:
                    rates[name].append(dst.nbytes / took / 1e9)
        report = {
            "blocks": args.blocks,
            "block_kib": args.block_kib,
            "batch_mib": round(dst.nbytes / (1 << 20), 1),
            "plain_gb_s": round(statistics.median(rates["plain"]), 3),
            "tls_gb_s": round(statistics.median(rates["tls"]), 3),
            "first_read_ms": first_ms,
        }
        report["tls_over_plain"] = round(report["tls_gb_s"] / report["plain_gb_s"], 2)
        print(json.dumps(report))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(report, fh, indent=2)
    finally:
        for transport in transports.values():
            transport.close()
        for proc, _, _ in daemons.values():
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
