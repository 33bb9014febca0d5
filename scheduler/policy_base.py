"""The one interface every routing policy implements, and the helpers they share.

A policy sees a ``RouteRequest`` and a ``ClusterState`` and returns a ``Decision``;
it must not mutate the state (the simulator or router applies the decision).
``observe`` lets a policy that keeps its own view (SGLang's approximate tree,
round-robin's counter, the adaptive remote-prefill threshold) learn what happened.
Randomness comes in as a seeded ``numpy.random.Generator``; nothing reads a clock.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import numpy as np

from kvpool.scheduler.cluster import ClusterState, Decision, PrefillKind, RouteRequest


class Policy(abc.ABC):
    name: ClassVar[str] = "base"

    @abc.abstractmethod
    def decide(self, req: RouteRequest, state: ClusterState) -> Decision:
        """Choose the prefill target and decode instance for ``req`` (or reject it)."""

    def observe(self, req: RouteRequest, decision: Decision, state: ClusterState) -> None:  # noqa: B027
        """Called after ``decision`` was applied; default: nothing to learn."""


def prefill_candidates(state: ClusterState) -> tuple[np.ndarray, PrefillKind]:
    """Disaggregated prefill instances, or the decode nodes when the cluster has none."""
    if state.spec.num_prefill > 0:
        return state.prefill_arr, "instance"
    return state.decode_arr, "decode_local"


def least_loaded_decode(state: ClusterState) -> int:
    """The decode instance holding the least KV (ties: fewest running requests, lowest id)."""
    members = state.decode_arr
    ctx = state.decode_context_tokens[members]
    act = state.decode_active[members]
    order = np.lexsort((members, act, ctx))
    return int(members[order[0]])


def explain(
    state: ClusterState,
    req: RouteRequest,
    prefill_member: int,
    kind: PrefillKind,
    decode_member: int,
    lens: np.ndarray | None = None,
    reason: str = "",
) -> Decision:
    """A decision annotated with the expected hit and TTFT, from the shared cost arithmetic."""
    if kind == "decode_local":
        decode_member = prefill_member
    if lens is None:
        lens = state.prefix_lengths(req.hashes)
    plan = state.plan_prefill(req, prefill_member, lens, decode_member)
    tpot = float(state.predicted_tpot_ms(req, np.array([decode_member]))[0])
    return Decision(kind, prefill_member, decode_member, plan.hit_blocks, plan.ttft_ms, tpot, False, reason)
