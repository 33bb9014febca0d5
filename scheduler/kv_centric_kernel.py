"""kv-centric's placement arithmetic as one compiled call (numba), for the 50 us decision budget.

Why compiled: at 64 instances a decision is ~25 numpy calls over 32-element arrays
(``predicted_tpot_ms``, ``plan_ttft_vector``, the occupancy term, two argmins), each ~1 - 2.5 us of
interpreter and dispatch overhead on a loaded core; the arithmetic itself is a few hundred
flops. One call into a loop over the instances does all of it for about the cost of one numpy
call. The prefix walk over the request's hashes stays in Python (it is dict lookups), written
into a reusable buffer.

The kernel is the *same* arithmetic as the reference path (``KvCentricPolicy.decide_reference``:
``predicted_tpot_ms`` -> decode, ``plan_ttft_vector`` with its sparse (<= 8 holders) and dense
branches -> TTFT and hit per prefill instance, ``_saved_ms`` -> score, first argmin), operation
for operation in the same order, so the two pick the same instances with the same predicted
TTFT / TPOT bit for bit (tests/property/test_sched_kernel.py checks it on random states).

Inputs: ``fr`` (float64, rows busy / NIC in / NIC out, ``ClusterState.f_rows``), ``ir`` (int64,
rows decode_active / decode_context_tokens, ``ClusterState.i_rows``), ``lens`` (prefix blocks per
member, pool last), ``prm`` (``static_params``: what depends only on the cluster and its cost
models; the policy's occupancy weight is an argument, so changing it takes effect at once).
numba is optional: without it ``load()`` returns None and the policy runs the reference path
(same decisions, slower).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool.scheduler.cluster import _SPARSE_HOLDERS, ClusterState

# prm layout
P_NUM_PREFILL, P_NUM_DECODE, P_POOL, P_POOL_ON, P_PEER_FETCH, P_CONTENTION = 0, 1, 2, 3, 4, 5
P_BT, P_A, P_HALF_B, P_BASE, P_KVB, P_BW, P_LAT, P_PER_BLOCK = 6, 7, 8, 9, 10, 11, 12, 13
P_DEC_BASE, P_DEC_SEQ, P_DEC_CTX, P_STATE = 14, 15, 16, 17
NUM_PARAMS = 18

_kernel: Callable[..., tuple[int, int, int, float, float]] | None = None
_tried = False


def static_params(state: ClusterState) -> np.ndarray:
    """The kernel's per-cluster constants (computed once per state, as the reference computes them)."""
    spec = state.spec
    pc, dc = state.role_cost["prefill"], state.role_cost["decode"]
    prm = np.zeros(NUM_PARAMS, dtype=np.float64)
    prm[P_NUM_PREFILL], prm[P_NUM_DECODE], prm[P_POOL] = spec.num_prefill, spec.num_decode, spec.pool_member
    prm[P_POOL_ON] = 1.0 if spec.pool_blocks != 0 else 0.0
    prm[P_PEER_FETCH] = 1.0 if spec.peer_fetch else 0.0
    prm[P_CONTENTION] = 1.0 if spec.nic_contention else 0.0
    prm[P_BT] = spec.block_tokens
    prm[P_A], prm[P_HALF_B], prm[P_BASE] = (
        pc.prefill_ms_per_token,
        0.5 * pc.prefill_ms_per_token_pair,
        pc.prefill_base_ms,
    )
    prm[P_KVB] = pc.kv_bytes_per_token
    prm[P_STATE] = pc.state_bytes_per_request  # a hybrid model's linear state travels with the KV
    prm[P_BW], prm[P_LAT] = spec.pool_bandwidth_bytes_per_s, spec.link_latency_ms
    prm[P_PER_BLOCK] = state.block_bytes * 1000.0 / spec.pool_bandwidth_bytes_per_s
    prm[P_DEC_BASE], prm[P_DEC_SEQ], prm[P_DEC_CTX] = (
        dc.decode_base_ms,
        dc.decode_ms_per_seq,
        dc.decode_ms_per_context_token,
    )
    return prm


def _decide(
    fr: np.ndarray,
    ir: np.ndarray,
    lens: np.ndarray,
    prm: np.ndarray,
    now: float,
    inp: int,
    out_tokens: int,
    n_blocks: int,
    weight: float,
) -> tuple[int, int, int, float, float]:
    """(prefill member, decode member, hit blocks, predicted TTFT ms, predicted TPOT ms); ``weight`` is
    the policy's ``occupancy_weight``."""
    num_p, num_d, pool = int(prm[P_NUM_PREFILL]), int(prm[P_NUM_DECODE]), int(prm[P_POOL])
    contention = prm[P_CONTENTION] != 0.0
    bt = int(prm[P_BT])
    a, half_b = prm[P_A], prm[P_HALF_B]
    lat, per_block = prm[P_LAT], prm[P_PER_BLOCK]
    # decode: lowest predicted TPOT (predicted_tpot_ms), first minimum
    e, c = prm[P_DEC_CTX], prm[P_DEC_SEQ]
    dbase = prm[P_DEC_BASE] + c + e * (inp + out_tokens // 2)
    d, best_tpot = -1, 0.0
    for m in range(num_p, num_p + num_d):
        t = (ir[1, m] * e + ir[0, m] * c) + dbase
        if d < 0 or t < best_tpot:
            d, best_tpot = m, t
    # fetch source (ClusterState._fetch_source)
    pool_len = lens[pool] if prm[P_POOL_ON] != 0.0 else 0
    peer, peer_len = -1, 0
    if prm[P_PEER_FETCH] != 0.0 and num_p + num_d > 0:
        peer, peer_len = 0, lens[0]
        for m in range(1, num_p + num_d):
            if lens[m] > peer_len:
                peer, peer_len = m, lens[m]
    if pool_len > 0 and pool_len >= peer_len:
        src, src_len = pool, pool_len
    elif peer_len > 0:
        src, src_len = peer, peer_len
    else:
        src, src_len = -1, 0
    reach = min(src_len, n_blocks)
    k = prm[P_BASE] + inp * (a + half_b * inp)
    holders = 0
    for j in range(num_p):
        if lens[j] != 0:
            holders += 1
    dec_has = min(min(lens[d], n_blocks) * bt, inp - 1)
    to_bytes = (inp - dec_has) * int(prm[P_KVB]) + int(prm[P_STATE])
    move = lat + to_bytes / prm[P_BW] * 1000.0 if to_bytes > 0 else 0.0
    floor_dec = max(now, fr[1, d]) if contention else now
    best_i, best_score, best_ttft, best_hit = -1, 0.0, 0.0, 0
    if holders > _SPARSE_HOLDERS:  # _plan_ttft_dense
        local_min = n_blocks
        for j in range(num_p):
            local_min = min(local_min, min(lens[j], n_blocks))
        fetch = src >= 0 and reach > local_min
        floor = now
        if contention and src != pool:
            floor = max(now, fr[2, src])
    else:  # plan_ttft_vector's sparse form
        fetch = src >= 0 and reach > 0
        floor = now
        if contention and src >= 0 and src != pool:
            floor = max(now, fr[2, src])
    c1 = min(reach * bt, inp - 1)
    k1 = k - c1 * (half_b * c1 + a)
    for j in range(num_p):
        local = min(lens[j], n_blocks)
        sq = max(fr[0, j], now)
        if holders > _SPARSE_HOLDERS:
            cached0 = min(local * bt, inp - 1)
            done = sq + (k - cached0 * (half_b * cached0 + a))
            hit = local
            if fetch:
                extra = max(reach - local, 0)
                begin = max(fr[1, j] if contention else now, floor)
                fetch_end = begin + (lat + extra * per_block)
                done1 = max(sq, fetch_end) + k1
                if done1 < done and extra > 0:
                    done, hit = done1, local + extra
        elif local == 0:
            done, hit = sq + k, 0
            if fetch:
                begin = max(fr[1, j], floor) if contention else floor
                done1 = max(sq, begin + (lat + reach * per_block)) + k1
                if done1 < done:
                    done, hit = done1, reach
        else:
            c0 = min(local * bt, inp - 1)
            done, hit = sq + (k - c0 * (half_b * c0 + a)), local
            if src >= 0 and reach > local:
                beg = max(fr[1, j], floor) if contention else floor
                d1 = max(sq, beg + (lat + (reach - local) * per_block)) + k1
                if d1 < done:
                    done, hit = d1, reach
        if contention:
            done = max(max(done, fr[2, j]), floor_dec)
        ttft = done + (move - now)
        score = ttft
        if weight > 0:
            cached = min(hit * bt, inp - 1)
            score = ttft - weight * (cached * (half_b * cached + a))
        if best_i < 0 or score < best_score:
            best_i, best_score, best_ttft, best_hit = j, score, ttft, hit
    return best_i, d, best_hit, best_ttft, best_tpot


def load() -> Callable[..., tuple[int, int, int, float, float]] | None:
    """The compiled kernel, or None without numba (the caller falls back to the reference path).
    Compiled on first use, cached on disk by numba (``cache=True``)."""
    global _kernel, _tried
    if not _tried:
        _tried = True
        try:
            import numba
        except ImportError:
            return None
        try:
            _kernel = numba.njit(cache=True, nogil=True)(_decide)
        except RuntimeError:  # no writable place for numba's cache (a read-only install): compile per process
            _kernel = numba.njit(nogil=True)(_decide)
    return _kernel


def python_kernel() -> Callable[..., Any]:
    """The same function uncompiled (tests run it without numba to cover the code under coverage)."""
    return _decide
