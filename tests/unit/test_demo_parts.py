"""The demo's pieces without processes: the word tokenizer, the split policy's decisions,
the bench's workloads (shared prefixes kept, the oracle) and its summary arithmetic."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.cli.demo_bench import REF_BLOCK_TOKENS, Outcome, conversation_workload, mixed_workload, summarize
from kvpool.core.clock import FakeClock
from kvpool.core.errors import InvalidArgument
from kvpool.core.events import EventKind, KVEvent
from kvpool.core.hashing import block_hashes
from kvpool.core.spec import KVSpec, Namespace
from kvpool.core.words import UNK_ID, WordTokenizer, render_chat
from kvpool.daemon.supervise import process_start_ticks, same_process_alive
from kvpool.scheduler.cluster import ClusterSpec
from kvpool.scheduler.cost_model import get_preset
from kvpool.scheduler.router_core import RouterCore, WorkerLoad
from kvpool.scheduler.router_openai import FrontDoor, Instance, SplitPolicy

SPEC = KVSpec(model="tiny", num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", block_tokens=32)
NS = Namespace(SPEC, b"demo")


@given(st.lists(st.integers(4, 1023), min_size=1, max_size=64))
def test_word_tokenizer_round_trips_every_word_id(ids: list[int]) -> None:
    tok = WordTokenizer.for_vocab(1024)
    assert tok.encode(tok.decode(ids)) == ids


def test_word_tokenizer_unknown_words_and_the_chat_template() -> None:
    tok = WordTokenizer(10)
    assert tok.encode("w0 w9 w10 hello w01x") == [4, 13, UNK_ID, UNK_ID, UNK_ID]
    assert render_chat([{"role": "user", "content": "w1"}]) == "user: w1\nassistant:"
    jinja2 = pytest.importorskip("jinja2")
    from kvpool.connectors.vllm_testing import CHAT_TEMPLATE

    messages = [{"role": "system", "content": "w5"}, {"role": "user", "content": "w1 w2"}]
    expected = jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert render_chat(messages) == expected  # the same text vLLM's tiny model renders


def core(policy: SplitPolicy, decode: int = 2) -> RouterCore:
    spec = ClusterSpec(num_prefill=1, num_decode=decode, block_tokens=32)
    return RouterCore(spec, get_preset("llama3-70b-a800x8"), policy, FakeClock(), NS)


def test_split_policy_short_or_cached_local_long_remote_down_skipped() -> None:
    policy = SplitPolicy(local_prefill_tokens=100)
    c = core(policy)
    short, long = list(range(4, 84)), list(range(4, 404))
    assert c.route(c.request_from(short, None, 0, 8, None)).decision.prefill_kind == "decode_local"
    r = c.route(c.request_from(long, None, 0, 8, None))
    assert (r.decision.prefill_kind, r.prefill_instance) == ("instance", "prefill-0")
    c.apply_event(KVEvent("node-0", 1, EventKind.STORED, tuple(block_hashes(NS, np.array(long)))))
    r = c.route(c.request_from(long, None, 0, 8, None))  # 399 of 400 cached: well-cached
    assert r.decision.prefill_kind == "decode_local" and r.expected_hit_tokens == 384
    c.report(WorkerLoad("decode-0", active_requests=3))
    assert c.route(c.request_from(short, None, 0, 8, None)).decode_instance == "decode-1"  # least loaded
    policy.down.add(c.names.index("decode-1"))
    assert c.route(c.request_from(short, None, 0, 8, None)).decode_instance == "decode-0"
    policy.down.add(c.names.index("prefill-0"))
    assert c.route(c.request_from(list(range(4, 704)), None, 0, 8, None)).decision.prefill_kind == "decode_local"
    policy.mode = "remote"
    assert c.route(c.request_from(short, None, 0, 8, None)).decision.rejected
    policy.down.add(c.names.index("decode-0"))
    policy.mode = "auto"
    r = c.route(c.request_from(short, None, 0, 8, None))
    assert r.decision.rejected and "no decode instance" in r.decision.reason


def test_split_policy_keeps_long_local_prefills_off_a_decoding_instance() -> None:
    policy = SplitPolicy(local_prefill_tokens=128, busy_local_prefill_tokens=32)
    c = core(policy, decode=1)
    tiny, short = list(range(4, 34)), list(range(4, 84))  # 30 and 80 uncached tokens
    assert c.route(c.request_from(short, None, 0, 8, None)).decision.prefill_kind == "decode_local"  # idle
    c.report(WorkerLoad("decode-0", active_requests=2))
    r = c.route(c.request_from(short, None, 0, 8, None))
    assert r.decision.prefill_kind == "instance" and "2 decoding there" in r.decision.reason
    assert c.route(c.request_from(tiny, None, 0, 8, None)).decision.prefill_kind == "decode_local"
    c.report(WorkerLoad("decode-0", active_requests=0))
    assert c.route(c.request_from(short, None, 0, 8, None)).decision.prefill_kind == "decode_local"
    with pytest.raises(InvalidArgument):
        SplitPolicy(128, busy_local_prefill_tokens=-1)


def test_front_door_reports_context_tokens_with_the_active_count() -> None:
    """The front door's load report replaces what the router charged at placement: it must carry
    the context tokens in flight too, or the least-loaded tie-break sees 0 after every report."""
    policy = SplitPolicy(local_prefill_tokens=128)
    c = core(policy, decode=1)
    door = FrontDoor(c, policy, [Instance("decode-0", "http://127.0.0.1:9")], WordTokenizer(16), "m")
    m = c.names.index("decode-0")
    door._busy(door.instances["decode-0"], 1, 300)
    door._busy(door.instances["decode-0"], 1, 40)
    assert (int(c.state.decode_active[m]), int(c.state.decode_context_tokens[m])) == (2, 340)
    door._busy(door.instances["decode-0"], -1, 300)
    assert (int(c.state.decode_active[m]), int(c.state.decode_context_tokens[m])) == (1, 40)


def test_conversation_slice_keeps_shared_prefixes_and_its_oracle(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 2048, "output_length": 100, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 1, "input_length": 1024, "output_length": 10, "hash_ids": [0, 9]},  # alone: dropped
        {"timestamp": 2, "input_length": 3000, "output_length": 50, "hash_ids": [0, 1, 2, 3, 4, 5]},
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    reqs, oracle = conversation_workload(str(trace), 5, 24, rate=2.0, seed=0)
    assert [len(r.prompt) for r in reqs] == [128, 188]  # 1/16 of the trace lengths
    assert reqs[0].prompt == reqs[1].prompt[:128]  # the shared blocks are the same tokens
    assert [r.max_tokens for r in reqs] == [6, 3]
    assert oracle == 128 + (188 - 4 * REF_BLOCK_TOKENS)  # the 2nd reuses the 4 blocks of the 1st
    assert reqs[0].arrival_s < reqs[1].arrival_s
    mixed = mixed_workload(16, 512, 8, 2.0, 0)
    assert sum(len(r.prompt) == 512 for r in mixed) == 2  # one in 8


def test_summary_arithmetic() -> None:
    local = Outcome(0.0, 100, 0.0, [0.5, 0.6, 0.8], {"prefill": "decode-local", "hit_tokens": 64})
    local.info["prefill_tokens_run"] = 36
    remote = Outcome(0.0, 200, 0.0, [1.0, 1.1], {"prefill": "prefill-0", "hit_tokens": 192, "prefill_tokens_run": 8})
    remote.info.update(prefill_instance_tokens_run=200, prefill_instance_hit_tokens=0, prefill_stored_blocks=6)
    failed = Outcome(0.0, 50, error="boom")
    s = summarize([local, remote, failed], oracle_tokens=236)
    assert s["failed"] == 1 and s["requests"] == 3
    assert s["recomputed_tokens"] == 236 and s["decode_tail_recomputed_tokens"] == 8
    assert s["hit_rate"] == pytest.approx(64 / 300)
    assert s["ttft_ms"]["p50"] == pytest.approx(750.0)
    assert sorted(round(v) for _, v in s["series"]["itl"]) == [100, 100, 200]
    assert s["kv_bytes_moved"] == (6 * 32 + 64 + 192) * 1024
    assert s["oracle_recomputed_share"] == pytest.approx(236 / 300)


def test_process_identity_for_the_state_file() -> None:
    me = process_start_ticks(os.getpid())
    assert me is not None and same_process_alive(os.getpid(), me)
    assert not same_process_alive(os.getpid(), me + 1)  # same PID, another process: not ours
    assert process_start_ticks(2**22 + 12345) is None


@given(
    prompt_blocks=st.integers(1, 20),
    cached_blocks=st.integers(0, 20),
    threshold=st.integers(0, 700),
    down=st.sets(st.sampled_from(["prefill-0", "decode-0", "decode-1"])),
    mode=st.sampled_from(["auto", "local", "remote"]),
)
def test_split_policy_never_picks_a_down_instance_and_splits_by_uncached_tokens(
    prompt_blocks: int, cached_blocks: int, threshold: int, down: set[str], mode: str
) -> None:
    policy = SplitPolicy(threshold, mode)  # type: ignore[arg-type]
    c = core(policy)
    prompt = list(range(4, 4 + prompt_blocks * 32 + 5))
    hashes = block_hashes(NS, np.array(prompt))
    cached = min(cached_blocks, len(hashes))
    if cached:
        c.apply_event(KVEvent("node-0", 1, EventKind.STORED, tuple(hashes[:cached])))
    policy.down = {c.names.index(n) for n in down}
    r = c.route(c.request_from(prompt, None, 0, 8, None))
    if r.decision.rejected:
        assert {"decode-0", "decode-1"} <= down or (mode == "remote" and "prefill-0" in down)
        return
    assert r.decode_instance not in down and r.prefill_instance not in down
    uncached = len(prompt) - cached * 32
    want_remote = "prefill-0" not in down and (mode == "remote" or (mode == "auto" and uncached > threshold))
    assert (r.decision.prefill_kind == "instance") == want_remote
