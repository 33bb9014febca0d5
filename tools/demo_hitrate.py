"""Draw docs/img/inspect_hitrate.png: ``kvpool inspect hitrate --plot`` against a daemon with a
small host tier (2 MiB) and a disk tier, while 40 prompts of 8 blocks are looked up, read and
put: uniformly for the first 7 s (most hits come from disk), then with an exponential skew
(the hot prompts stay in host memory: the host share of the hits rises).

    .venv/bin/python tools/demo_hitrate.py [--out docs/img/inspect_hitrate.png]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kvpool import KVSpec, PoolClient
from kvpool.daemon.cluster_local import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
SPEC = KVSpec(model="demo", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
RUN_S = 18.0
UNIFORM_S = 7.0


def workload(address: str, stop: threading.Event) -> None:
    rng = random.Random(1)
    prompts = [list(range(p * 10_000, p * 10_000 + 16 * 8)) for p in range(40)]
    started = time.monotonic()
    with PoolClient.connect(address, SPEC) as client:
        while not stop.is_set():
            skewed = time.monotonic() - started > UNIFORM_S
            prompt = prompts[min(int(rng.expovariate(0.15)), 39)] if skewed else prompts[rng.randrange(40)]
            hashes = client.hashes(prompt)
            n = client.lookup(hashes)
            if n:
                client.get(hashes[:n])
            if n < len(hashes):
                client.put(hashes[n:], np.zeros((len(hashes) - n, *SPEC.block_shape), dtype=np.float16))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "img" / "inspect_hitrate.png"))
    args = parser.parse_args()
    address = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as disk:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", "serve", "--listen", address, "--capacity-bytes", "2MiB",
             "--slab-bytes", "1MiB", "--disk-dir", disk, "--disk-capacity-bytes", "64MiB",
             "--disk-slab-file-bytes", "16MiB"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        stop = threading.Event()
        try:
            wait_until(lambda: PoolClient.connect(address, SPEC).close() is None, 30, "daemon", daemon)
            worker = threading.Thread(target=workload, args=(address, stop))
            worker.start()
            done = subprocess.run(
                [sys.executable, "-m", "kvpool.cli.main", "inspect", "hitrate", "--address", address,
                 "--samples", str(int(RUN_S) - 2), "--interval-s", "1", "--plot", args.out],
                cwd=ROOT,
            )  # fmt: skip
            stop.set()
            worker.join()
        finally:
            stop.set()
            daemon.terminate()
            daemon.wait(10)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
