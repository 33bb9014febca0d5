"""Hit rate of each eviction policy on the Mooncake conversation trace, beside LRU and
the infinite-cache oracle, at several capacities (in 512-token blocks).

Each policy in ``kvpool.storage.eviction.POLICIES`` is driven exactly as a tier drives it:
``on_insert`` when a missed block is stored, ``on_access`` on a hit, ``pop_victim`` when the
tier is full. A request's blocks are looked up in order; every block counts (hit or miss),
which is how the trace README's LRU figures are computed, so the LRU column here doubles as
a check of the simulator against them (13.6% / 28.8% / 36.4%).

    .venv/bin/python tools/bench_eviction.py [--trace PATH] [--capacities 2000,5859,...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from kvpool.storage.eviction import POLICIES, make_policy

DEFAULT_TRACE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "conversation_trace.jsonl"
README_LRU = {5859: 0.136, 20000: 0.288, 97656: 0.364}


def load_trace(path: pathlib.Path) -> list[list[int]]:
    with path.open() as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


def oracle_hit_rate(requests: list[list[int]]) -> float:
    seen: set[int] = set()
    hits = total = 0
    for ids in requests:
        for h in ids:
            total += 1
            if h in seen:
                hits += 1
            else:
                seen.add(h)
    return hits / total


def simulate(requests: list[list[int]], policy_name: str, capacity_blocks: int) -> float:
    policy = make_policy(policy_name)
    resident: set[bytes] = set()
    hits = total = 0
    always = lambda _key: True  # noqa: E731 -- nothing is leased or pinned in the replay
    for ids in requests:
        for h in ids:
            key = h.to_bytes(8, "little")
            total += 1
            if key in resident:
                hits += 1
                policy.on_access(key)
                continue
            while len(resident) >= capacity_blocks:
                victim = policy.pop_victim(always)
                if victim is None:
                    raise RuntimeError(f"{policy_name} returned no victim with {len(resident)} resident")
                resident.discard(victim)
            resident.add(key)
            policy.on_insert(key)
    return hits / total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=pathlib.Path, default=DEFAULT_TRACE)
    parser.add_argument("--capacities", default="1000,2000,5859,10000,20000,50000,97656")
    parser.add_argument("--policies", default=",".join(sorted(POLICIES)))
    args = parser.parse_args(argv)
    requests = load_trace(args.trace)
    capacities = [int(c) for c in args.capacities.split(",")]
    policies = ["lru"] + [p for p in args.policies.split(",") if p != "lru"]
    oracle = oracle_hit_rate(requests)
    print(f"trace: {len(requests)} requests, {sum(map(len, requests))} block lookups; oracle (infinite) {oracle:.1%}")
    header = (
        f"{'capacity':>9} "
        + " ".join(f"{p:>8}" for p in policies)
        + "  "
        + " ".join(f"{p + '/lru':>11}" for p in policies[1:])
        + "  readme-lru"
    )
    print(header)
    for cap in capacities:
        rates = {p: simulate(requests, p, cap) for p in policies}
        row = f"{cap:>9} " + " ".join(f"{rates[p]:>8.1%}" for p in policies) + "  "
        row += " ".join(f"{rates[p] / rates['lru']:>10.3f}x" for p in policies[1:])
        row += f"  {README_LRU[cap]:.1%}" if cap in README_LRU else "  -"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
