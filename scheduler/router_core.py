"""The router's brain: cluster state fed by worker reports and pool KV events, and a
policy that places each request. Transport-free (gRPC and HTTP wrap it elsewhere).

Why it updates its own state after a decision: workers report every so often; in
between, the router charges its own placements (predicted prefill time onto the
queue, the request onto the decode batch) so a burst is not all sent to the
instance that looked idle at the last report. The next report overwrites the guess.

Block locations: an event from a node whose id is one of the router's instance
names marks blocks on that instance; any other node is the global pool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.core.clock import Clock
from kvpool.core.errors import InvalidArgument, NotFound
from kvpool.core.events import EventKind, KVEvent
from kvpool.core.hashing import HASH_BYTES, block_hashes
from kvpool.core.spec import Namespace
from kvpool.scheduler.cluster import ClusterSpec, ClusterState, Decision, RouteRequest, Slo
from kvpool.scheduler.cost_model import CostModel
from kvpool.scheduler.policy_base import Policy


@dataclass(frozen=True)
class WorkerLoad:
    instance: str
    queue_ms: float = 0.0
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    active_requests: int = 0
    context_tokens: int = 0


@dataclass(frozen=True)
class RouteResult:
    decision: Decision
    prefill_instance: str
    decode_instance: str
    expected_hit_tokens: int
    decision_us: float


def instance_names(spec: ClusterSpec) -> list[str]:
    """prefill-0.., decode-0.., remote-0..: member order of ``ClusterState``."""
    return (
        [f"prefill-{i}" for i in range(spec.num_prefill)]
        + [f"decode-{i}" for i in range(spec.num_decode)]
        + [f"remote-{i}" for i in range(spec.num_remote_prefill)]
    )


class RouterCore:
    """Thread-safe: one lock around state, index and policy (decisions are microseconds)."""

    def __init__(
        self,
        spec: ClusterSpec,
        cost: CostModel,
        policy: Policy,
        clock: Clock,
        namespace: Namespace | None = None,
        default_slo: Slo | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        self.spec = spec
        self.state = ClusterState(spec, cost)
        self.policy = policy
        self.clock = clock
        self.namespace = namespace
        self.default_slo = default_slo or Slo()
        self.names = list(names) if names is not None else instance_names(spec)
        if len(self.names) != spec.num_instances or len(set(self.names)) != len(self.names):
            raise InvalidArgument(f"need {spec.num_instances} distinct instance names, got {self.names}")
        self._member = {n: i for i, n in enumerate(self.names)}
        self._lock = threading.Lock()
        self.events_applied = 0
        self.resyncs = 0
        self.last_seq: dict[str, int] = {}
        self.decisions = 0
        self.rejections = 0

    # ---- inputs --------------------------------------------------------------------
    def member_of_node(self, node_id: str) -> int:
        return self._member.get(node_id, self.spec.pool_member)

    def report(self, load: WorkerLoad) -> None:
        m = self._member.get(load.instance)
        if m is None:
            raise NotFound(f"unknown instance {load.instance!r}", hint=f"known instances: {self.names}")
        if (
            min(
                load.queue_ms,
                load.outstanding_requests,
                load.outstanding_tokens,
                load.active_requests,
                load.context_tokens,
            )
            < 0
        ):
            raise InvalidArgument("load figures must be >= 0")
        with self._lock:
            st = self.state
            now = self.clock.now_ms()
            st.busy_until_ms[m] = now + load.queue_ms
            st.outstanding_requests[m] = load.outstanding_requests
            st.outstanding_tokens[m] = load.outstanding_tokens
            st.decode_active[m] = load.active_requests
            st.decode_context_tokens[m] = load.context_tokens

    def apply_event(self, ev: KVEvent) -> None:
        if self.namespace is not None and ev.namespace and ev.namespace != self.namespace.digest():
            return
        m = self.member_of_node(ev.node_id)
        with self._lock:
            idx = self.state.index
            if ev.kind is EventKind.STORED:
                idx.add_many(ev.hashes, m)
            elif ev.kind is EventKind.REMOVED:
                for h in ev.hashes:
                    idx.remove(h, m)
            else:
                idx.clear_member(m)
            self.events_applied += 1
            self.last_seq[ev.node_id] = ev.seq

    def resync(self, node_id: str, last_seq: int, hashes: Sequence[bytes]) -> None:
        """Replace everything known about ``node_id`` with a snapshot."""
        m = self.member_of_node(node_id)
        with self._lock:
            self.state.index.clear_member(m)
            self.state.index.add_many(hashes, m)
            self.last_seq[node_id] = last_seq
            self.resyncs += 1

    # ---- decisions -----------------------------------------------------------------
    def request_from(
        self,
        token_ids: Sequence[int] | None,
        hashes: Sequence[bytes] | None,
        input_tokens: int,
        output_tokens: int,
        slo: Slo | None,
        request_id: int = 0,
    ) -> RouteRequest:
        if bool(token_ids) == bool(hashes):
            raise InvalidArgument("give exactly one of token_ids and hashes")
        if output_tokens < 0:
            raise InvalidArgument("output_tokens must be >= 0")
        bt = self.spec.block_tokens
        if token_ids:
            if self.namespace is None:
                raise InvalidArgument(
                    "this router has no namespace to hash tokens in",
                    hint="send block hashes, or start the router with --spec (the model's KVSpec)",
                )
            hs = block_hashes(self.namespace, np.asarray(token_ids, dtype=np.int64))
            n_in = len(token_ids)
        else:
            assert hashes is not None
            if any(len(h) != HASH_BYTES for h in hashes):
                raise InvalidArgument(f"block hashes must be {HASH_BYTES} bytes each")
            hs = list(hashes)
            n_in = input_tokens or len(hs) * bt
            if n_in < len(hs) * bt:
                raise InvalidArgument(f"input_tokens {n_in} is shorter than {len(hs)} full blocks")
        if n_in <= 0:
            raise InvalidArgument("the prompt is empty")
        return RouteRequest(hs, n_in, max(1, output_tokens), slo or self.default_slo, request_id)

    def route(self, req: RouteRequest) -> RouteResult:
        with self._lock:
            st = self.state
            st.now_ms = self.clock.now_ms()
            t0 = time.perf_counter_ns()
            d = self.policy.decide(req, st)
            us = (time.perf_counter_ns() - t0) / 1000.0
            self.policy.observe(req, d, st)
            self.decisions += 1
            if d.rejected:
                self.rejections += 1
                return RouteResult(d, "", "", 0, us)
            hit_tokens = req.cached_tokens(d.expected_hit_blocks, self.spec.block_tokens)
            self._charge(req, d, hit_tokens)
        return RouteResult(d, self.names[d.prefill_member], self.names[d.decode_member], hit_tokens, us)

    def _charge(self, req: RouteRequest, d: Decision, cached: int) -> None:
        """Charge the placement from the decision's expected hit, ``cached`` tokens (no second
        index walk: the fetch of a cached prefix is small next to the prefill it saves)."""
        st = self.state
        m = d.prefill_member
        new = req.input_tokens - cached
        st.busy_until_ms[m] = max(float(st.busy_until_ms[m]), st.now_ms) + float(st.cost.prefill_ms(new, cached))
        st.outstanding_requests[m] += 1
        st.outstanding_tokens[m] += new
        st.decode_active[d.decode_member] += 1
        st.decode_context_tokens[d.decode_member] += req.input_tokens + req.output_tokens

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {
                "policy": self.policy.name,
                "instances": list(self.names),
                "indexed_blocks": len(self.state.index),
                "events_applied": self.events_applied,
                "resyncs": self.resyncs,
                "last_seq": max(self.last_seq.values(), default=0),
                "decisions": self.decisions,
                "rejections": self.rejections,
            }
