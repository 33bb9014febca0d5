"""Generated request traces, in the same format as the Mooncake trace (``trace.py``), so
users can see which policy suits traffic shaped like theirs.

A prompt is a list of *segments* (a system prompt, a document, a tool output, a user
turn), each with an id and a length in tokens. Block ids are assigned the way the
Mooncake trace's are: one id per 512-token block, prefix-chained -- two requests share a
block id exactly when their prompts agree up to the end of that block. Arrivals are a
Poisson process; popularity of shared content is Zipf. Every knob is a field of
``WorkloadSpec`` (documented in docs/scheduler.md, "Workloads"); a seed fixes the trace.

Kinds:

* ``agent``: tool / agent sessions over a few long shared prefixes (the system prompt and
  tool schemas of an agent framework); every step appends a tool result and a short
  reasoning turn, so later steps share everything before them; short outputs.
* ``docqa``: questions over long documents (Zipf popularity): document + a short
  question; the document is the shared prefix.
* ``chat``: short multi-turn chat: a small shared system prompt, short user turns, longer
  answers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvpool.core.errors import InvalidArgument
from kvpool.scheduler.trace import TRACE_BLOCK_TOKENS, TraceRequest

Kind = Literal["agent", "docqa", "chat"]


@dataclass(frozen=True)
class WorkloadSpec:
    kind: Kind = "agent"
    requests: int = 6000
    rate_rps: float = 3.0  # Poisson arrivals
    shared_prefixes: int = 8  # agent: frameworks / tool sets; docqa: documents; chat: system prompts
    shared_prefix_tokens: tuple[int, int] = (8_000, 16_000)  # uniform range of a shared prefix's length
    zipf_a: float = 1.1  # popularity of the shared prefixes (higher: a few dominate)
    turn_tokens: tuple[int, int] = (500, 3_000)  # what each step / question / user turn appends
    turns: tuple[int, int] = (1, 8)  # steps per session (docqa: questions per reader, each on its own)
    concurrent_sessions: int = 64  # sessions interleaved at any time
    output_tokens: tuple[int, int] = (50, 400)
    max_input_tokens: int = 128_000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("agent", "docqa", "chat"):
            raise InvalidArgument(f"unknown workload kind {self.kind!r}", hint="use agent, docqa or chat")
        if self.requests <= 0 or not self.rate_rps > 0 or self.shared_prefixes <= 0 or self.concurrent_sessions <= 0:
            raise InvalidArgument("requests, rate_rps, shared_prefixes and concurrent_sessions must be positive")
        for name in ("shared_prefix_tokens", "turn_tokens", "turns", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise InvalidArgument(f"WorkloadSpec.{name} must be 0 < lo <= hi, got {(lo, hi)}")
        if not self.zipf_a > 1.0:
            raise InvalidArgument("zipf_a must be > 1")


#: Defaults per kind (any field can still be overridden).
KIND_DEFAULTS: dict[str, dict[str, object]] = {
    "agent": {},
    "docqa": dict(
        shared_prefixes=200,
        shared_prefix_tokens=(20_000, 60_000),
        turn_tokens=(50, 300),
        turns=(1, 1),
        output_tokens=(100, 400),
        zipf_a=1.2,
        rate_rps=1.0,
    ),
    "chat": dict(
        shared_prefixes=4,
        shared_prefix_tokens=(500, 1_500),
        turn_tokens=(50, 600),
        turns=(2, 12),
        output_tokens=(150, 600),
        rate_rps=8.0,
    ),
}


def workload_spec(kind: str, **overrides: object) -> WorkloadSpec:
    if kind not in KIND_DEFAULTS:
        raise InvalidArgument(f"unknown workload kind {kind!r}", hint=f"use one of {sorted(KIND_DEFAULTS)}")
    known = {f.name for f in dataclasses.fields(WorkloadSpec)} - {"kind"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise InvalidArgument(f"unknown workload knob(s) {unknown}", hint=f"knobs: {sorted(known)}")
    fields = {**KIND_DEFAULTS[kind], **overrides, "kind": kind}
    return WorkloadSpec(**fields)  # type: ignore[arg-type]


class _BlockIds:
    """Prefix-chained block ids: the id of a block is a function of the whole prompt up to its end."""

    def __init__(self) -> None:
        self._ids: dict[tuple[tuple[int, ...], int], int] = {}

    def of(self, segments: list[tuple[int, int]]) -> tuple[int, ...]:
        out: list[int] = []
        seg_ids: list[int] = []
        pos = 0
        edges = []  # (end token, seg ids so far)
        for sid, length in segments:
            seg_ids.append(sid)
            pos += length
            edges.append((pos, tuple(seg_ids)))
        total = pos
        k = 0
        for end in range(TRACE_BLOCK_TOKENS, total + TRACE_BLOCK_TOKENS, TRACE_BLOCK_TOKENS):
            end = min(end, total)
            while edges[k][0] < end:
                k += 1
            key = (edges[k][1], end)
            out.append(self._ids.setdefault(key, len(self._ids)))
        return tuple(out)


def generate(spec: WorkloadSpec) -> list[TraceRequest]:
    """The trace ``spec`` describes (deterministic in ``spec.seed``)."""
    rng = np.random.default_rng(spec.seed)
    ids = _BlockIds()
    lo, hi = spec.shared_prefix_tokens
    prefix_len = rng.integers(lo, hi + 1, size=spec.shared_prefixes)
    next_seg = spec.shared_prefixes

    def new_session() -> tuple[list[tuple[int, int]], int]:
        p = int(min(rng.zipf(spec.zipf_a), spec.shared_prefixes)) - 1
        return [(p, int(prefix_len[p]))], int(rng.integers(spec.turns[0], spec.turns[1] + 1))

    sessions = [new_session() for _ in range(spec.concurrent_sessions)]
    t_ms = 0.0
    out: list[TraceRequest] = []
    for i in range(spec.requests):
        t_ms += float(rng.exponential(1000.0 / spec.rate_rps))
        k = int(rng.integers(len(sessions)))
        segs, left = sessions[k]
        segs = [*segs, (next_seg, int(rng.integers(spec.turn_tokens[0], spec.turn_tokens[1] + 1)))]
        next_seg += 1
        n_in = min(sum(n for _, n in segs), spec.max_input_tokens)
        n_out = int(rng.integers(spec.output_tokens[0], spec.output_tokens[1] + 1))
        block_ids = ids.of(segs)[: -(-n_in // TRACE_BLOCK_TOKENS)]
        out.append(TraceRequest(i, round(t_ms, 3), n_in, n_out, block_ids))
        if spec.kind == "docqa" or left <= 1 or n_in >= spec.max_input_tokens:
            sessions[k] = new_session()
        else:  # the answer becomes part of the next step's prompt
            sessions[k] = ([*segs, (next_seg, n_out)], left - 1)
            next_seg += 1
    return out


def to_jsonl(trace: list[TraceRequest]) -> str:
    """The Mooncake trace format (see docs/scheduler.md, "Trace format")."""
    import json

    return "".join(
        json.dumps(
            {
                "timestamp": r.arrival_ms,
                "input_length": r.input_tokens,
                "output_length": r.output_tokens,
                "hash_ids": list(r.block_ids),
            }
        )
        + "\n"
        for r in trace
    )
