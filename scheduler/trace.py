"""Request traces (Mooncake FAST'25 format) and deterministic token synthesis.

A trace line is ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [block ids]}``, one id per 512-token block, prefix-chained. The trace
carries no tokens, so ``TraceHasher`` synthesises each block's tokens from its id
(equal id -> equal tokens) and runs the real ``kvpool.core.hashing.chain_hashes``, so
the simulator exercises the same hashes and index code as the router. Each id is
hashed once and cached, which keeps a 12k-request replay to about a second.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.core.errors import InvalidArgument
from kvpool.core.hashing import chain_hashes
from kvpool.core.spec import KVSpec, Namespace

TRACE_BLOCK_TOKENS = 512
REQUIRED_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]


def parse_trace_lines(lines: Iterable[str], source: str = "<trace>") -> list[TraceRequest]:
    """Parse and validate; a bad line raises InvalidArgument naming the line."""
    out: list[TraceRequest] = []
    last_ms = -np.inf
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{source}:{lineno}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise InvalidArgument(f"{source}:{lineno}: expected a JSON object")
        missing = [f for f in REQUIRED_FIELDS if f not in obj]
        if missing:
            raise InvalidArgument(
                f"{source}:{lineno}: missing field(s) {missing}",
                hint=f"every trace line needs {list(REQUIRED_FIELDS)}",
            )
        ts, n_in, n_out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
        if not isinstance(ts, int | float) or ts < 0:
            raise InvalidArgument(f"{source}:{lineno}: timestamp must be a number >= 0, got {ts!r}")
        for name, v in (("input_length", n_in), ("output_length", n_out)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidArgument(f"{source}:{lineno}: {name} must be an int >= 0, got {v!r}")
        if n_in <= 0:
            raise InvalidArgument(f"{source}:{lineno}: input_length must be positive")
        if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise InvalidArgument(f"{source}:{lineno}: hash_ids must be a list of ints >= 0")
        if ts < last_ms:
            raise InvalidArgument(
                f"{source}:{lineno}: timestamp {ts} is earlier than the previous line's {last_ms}",
                hint="sort the trace by timestamp",
            )
        last_ms = ts
        out.append(TraceRequest(len(out), float(ts), n_in, max(1, n_out), tuple(ids)))
    if not out:
        raise InvalidArgument(f"{source}: the trace is empty")
    return out


def load_trace(path: str | pathlib.Path, limit: int | None = None) -> list[TraceRequest]:
    p = pathlib.Path(path)
    if not p.exists():
        raise InvalidArgument(f"trace {p} does not exist")
    with p.open() as f:
        lines = f if limit is None else (line for _, line in zip(range(limit), f))
        return parse_trace_lines(lines, str(p))


def synth_block_tokens(block_ids: np.ndarray, block_tokens: int, vocab: int = 128_000) -> np.ndarray:
    """Deterministic tokens for each id: splitmix64(id * block_tokens + position) % vocab.

    Shape (len(ids), block_tokens), dtype uint32. A pure function of the id, so equal
    ids always give equal tokens on every machine.
    """
    ids = np.asarray(block_ids, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = ids[:, None] * np.uint64(block_tokens) + np.arange(block_tokens, dtype=np.uint64)[None, :]
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(vocab)).astype(np.uint32)


def synth_spec(block_tokens: int = TRACE_BLOCK_TOKENS) -> KVSpec:
    """The namespace the synthetic trace tokens are hashed in."""
    return KVSpec(
        model="trace-synth", num_layers=80, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=block_tokens
    )


class TraceHasher:
    """Block id -> 16-byte chained hash, through the real hashing code, cached per id."""

    def __init__(self, namespace: Namespace | None = None) -> None:
        self.namespace = namespace or Namespace(synth_spec())
        self.block_tokens = self.namespace.spec.block_tokens
        if self.block_tokens != TRACE_BLOCK_TOKENS:
            raise InvalidArgument(
                f"trace blocks are {TRACE_BLOCK_TOKENS} tokens, namespace has {self.block_tokens}",
                hint="hash the trace in a namespace with block_tokens=512",
            )
        self._seed = self.namespace.digest()
        self._by_id: dict[int, bytes] = {}
        self.blocks_hashed = 0

    def hashes(self, block_ids: Sequence[int]) -> list[bytes]:
        by_id = self._by_id
        first_new = len(block_ids)
        for i, b in enumerate(block_ids):
            if b not in by_id:
                first_new = i
                break
        if first_new < len(block_ids):
            prev = self._seed if first_new == 0 else by_id[block_ids[first_new - 1]]
            new_ids = block_ids[first_new:]
            tokens = synth_block_tokens(np.asarray(new_ids), self.block_tokens).ravel()
            chained = chain_hashes(prev, tokens, self.block_tokens)
            self.blocks_hashed += len(chained)
            for b, h in zip(new_ids, chained):
                by_id.setdefault(b, h)
        return [by_id[b] for b in block_ids]


def oracle_hit_blocks(trace: Sequence[TraceRequest]) -> np.ndarray:
    """Per request: its prefix blocks an infinite cache would hold (ids seen earlier)."""
    seen: set[int] = set()
    out = np.zeros(len(trace), dtype=np.int64)
    for i, r in enumerate(trace):
        k = 0
        for b in r.block_ids:
            if b not in seen:
                break
            k += 1
        out[i] = k
        seen.update(r.block_ids)
    return out


def oracle_hit_rate(trace: Sequence[TraceRequest]) -> tuple[float, float]:
    """Infinite-cache prefix hit rate: (fraction of blocks, fraction of input tokens).

    A block hits if its id was seen in an earlier request (the leading run only:
    the prefix stops at the first miss). Tokens: the hit blocks' tokens, capped at
    the prompt length.
    """
    seen: set[int] = set()
    hit_blocks = total_blocks = hit_tokens = total_tokens = 0
    for r in trace:
        k = 0
        for b in r.block_ids:
            if b not in seen:
                break
            k += 1
        hit_blocks += k
        total_blocks += len(r.block_ids)
        hit_tokens += min(k * TRACE_BLOCK_TOKENS, r.input_tokens)
        total_tokens += r.input_tokens
        seen.update(r.block_ids)
    return hit_blocks / max(1, total_blocks), hit_tokens / max(1, total_tokens)
