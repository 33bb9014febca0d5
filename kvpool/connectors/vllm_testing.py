"""Test kit for the vLLM connector, next to the code it exercises (trio.testing style).

* ``make_tiny_model(path)``: a small Llama-style model directory made offline — a
  ``config.json``, random weights saved by transformers (``initializer_range`` 0.2, so
  logits are far from uniform and wrong KV changes the output), and a word-level tokenizer
  built with the ``tokenizers`` library plus a chat template — so ``vllm serve`` answers
  text prompts on ``/v1/completions`` and ``/v1/chat/completions`` with no hub download.
* ``python -m kvpool.connectors.vllm_testing run ...``: one real vLLM engine (``LLM``) that
  runs a JSON script of phases and writes what it saw (token ids, logprobs, cached tokens)
  after each phase. A phase may wait for a file first (``wait_for``), so a test can kill or
  restart the pool between phases of the same engine, and then idle (``settle_s``); its
  requests may carry the connector's ``kv_transfer_params`` (``{"kvpool": "skip"}``); the
  engine takes ~30 s to start, so tests run several phases in one engine instead of
  starting many. With the kvpool connector's ``stats_path``, each phase also records the
  connector's own time in it (``connector_s``, and by kind in ``connector``; when that is
  exact: ``connector_times``).

vLLM and transformers are imported inside the functions that use them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

#: The tiny model's shape: 2 layers, hidden 128, 4 query heads, 2 KV heads (GQA), head_dim 32.
TINY_MODEL: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 8192,
}
WORDS = 2000  # word-level vocabulary: "w0" .. "w1999" plus special tokens
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_tiny_model(path: str | Path, seed: int = 0, sliding_window: int = 0, **overrides: Any) -> Path:
    """Write a tiny random-weight Llama model with a tokenizer to ``path``; returns it.

    ``sliding_window`` > 0 makes it a Mistral-style sliding-window model instead."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    shape = {**TINY_MODEL, **overrides}
    config_cls, model_cls = (MistralConfig, MistralForCausalLM) if sliding_window else (LlamaConfig, LlamaForCausalLM)
    if sliding_window:
        shape["sliding_window"] = sliding_window
    config = config_cls(
        **shape,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        dtype="float32",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(out)
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for i in range(min(WORDS, shape["vocab_size"] - len(SPECIAL))):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out


def words(token_ids: list[int]) -> str:
    """The text that the tiny tokenizer turns into exactly these ids (ids >= 4)."""
    return " ".join(f"w{i - len(SPECIAL)}" for i in token_ids)


def kv_transfer_config(pool_address: str, role: str = "kv_both", **options: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of the kvpool connector."""
    return {
        "kv_connector": "KvpoolConnector",
        "kv_role": role,
        "kv_connector_module_path": "kvpool.connectors.vllm",
        "kv_load_failure_policy": "recompute",  # a corrupt or vanished block is recomputed, not an error
        "kv_connector_extra_config": {"pool_address": pool_address, **options},
    }


def _wait_for(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test never wrote {path}")
        time.sleep(0.05)


#: the kvpool connector's counters of its own time (kvpool.connectors.vllm.ConnectorStats)
CONNECTOR_TIMES = ("load_s", "save_s", "scheduler_s")


def connector_counters(stats_path: str) -> dict[str, dict[str, Any]]:
    """The kvpool connector's counters (``kvpool.connectors.vllm.ConnectorStats``) by role,
    "scheduler" and "worker", as it last wrote them at ``stats_path``.<role>.json (a role
    that has not written yet, or no ``stats_path``, is left out)."""
    counters: dict[str, dict[str, Any]] = {}
    for role in ("scheduler", "worker"):
        path = Path(f"{stats_path}.{role}.json")
        if stats_path and path.exists():
            counters[role] = json.loads(path.read_text())
    return counters


def connector_times(stats_path: str) -> dict[str, float]:
    """The kvpool connector's own time so far, by kind (``CONNECTOR_TIMES``: loads and saves
    on the engine step, the scheduler's lookups), summed over its scheduler and worker
    (``connector_counters``; 0 before the first write). The connector writes them at a
    step, at most once a second, so a read sees them as of the last step that wrote: a phase
    that starts over a second after the last write (``settle_s``) gets its first step's
    work; the work of a later step of it shows in the next phase's figure. Exact for phases
    whose connector work is all in their first step (one prompt prefilled in one step,
    ``max_tokens`` 1, as in tools/bench_vllm.py, which checks it: its prompts that skip the
    pool must read 0)."""
    by_role = connector_counters(stats_path).values()
    return {kind: sum(counters[kind] for counters in by_role) for kind in CONNECTOR_TIMES}


def run_script(args: argparse.Namespace) -> None:
    """Start one engine and run the phases of ``args.script`` (see the module docstring)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    script = json.loads(Path(args.script).read_text())
    engine_args: dict[str, Any] = {
        "model": args.model,
        "skip_tokenizer_init": True,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": 0.1,
        "enable_prefix_caching": not args.no_prefix_caching,
        "seed": 0,
        "enforce_eager": True,
    }
    stats_path = ""
    if args.kv_transfer_config:
        engine_args["kv_transfer_config"] = json.loads(args.kv_transfer_config)
        stats_path = engine_args["kv_transfer_config"].get("kv_connector_extra_config", {}).get("stats_path", "")
    t0 = time.perf_counter()
    llm = LLM(**engine_args)
    results: dict[str, Any] = {"start_s": time.perf_counter() - t0, "phases": []}
    for i, phase in enumerate(script["phases"]):
        if phase.get("wait_for"):
            _wait_for(phase["wait_for"], float(phase.get("wait_timeout_s", 120)))
        # "settle_s": idle first, so work another process left running (a connector's
        # background commit, a daemon's) is done before this phase is timed
        time.sleep(float(phase.get("settle_s", 0)))
        connector_before = connector_times(stats_path)
        # "kv_transfer_params": the connector's per-request parameters, e.g. {"kvpool": "skip"}
        extra = {"kv_transfer_params": phase["kv_transfer_params"]} if "kv_transfer_params" in phase else None
        params = SamplingParams(
            max_tokens=int(phase.get("max_tokens", 8)), temperature=0.0, logprobs=3, extra_args=extra
        )
        prompts = [{"prompt_token_ids": p} for p in phase["prompts"]]
        # "sequential": one generate call per prompt, each timed (max_tokens=1: the TTFT)
        batches = [[p] for p in prompts] if phase.get("sequential") else [prompts]
        rows = []
        t1 = time.perf_counter()
        for batch in batches:
            t2 = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)  # type: ignore[arg-type]
            took_s = time.perf_counter() - t2
            for out in outs:
                comp = out.outputs[0]
                chosen = [lp[tok].logprob for tok, lp in zip(comp.token_ids, comp.logprobs or []) if lp]
                row = {"tokens": list(comp.token_ids), "logprobs": chosen, "cached": out.num_cached_tokens}
                rows.append({**row, "seconds": took_s})
        took = time.perf_counter() - t1
        done = {"name": phase.get("name", str(i)), "seconds": took, "outputs": rows}
        if stats_path:
            spent = {k: v - connector_before[k] for k, v in connector_times(stats_path).items()}
            done["connector_s"], done["connector"] = sum(spent.values()), spent
        results["phases"].append(done)
        Path(args.out).write_text(json.dumps(results))
        Path(f"{args.out}.phase{i}.done").touch()
    del llm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpool.connectors.vllm_testing", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-model", help="write the tiny model directory")
    mk.add_argument("path")
    mk.add_argument("--seed", type=int, default=0)
    run = sub.add_parser("run", help="run a JSON script of phases in one vLLM engine")
    run.add_argument("--model", required=True)
    run.add_argument("--script", required=True, help='{"phases": [{"prompts": [[ids]], "wait_for": path?}]}')
    run.add_argument("--out", required=True, help="results JSON, rewritten after each phase")
    run.add_argument("--kv-transfer-config", default="", help="JSON; empty = vLLM without the pool")
    run.add_argument("--max-model-len", type=int, default=4096)
    run.add_argument("--no-prefix-caching", action="store_true")
    run.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    if args.cmd == "make-model":
        print(make_tiny_model(args.path, args.seed))
        return 0
    run_script(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
