"""Cost of the weight fingerprint: a transformers model of N MB vs a plain xxh3-128 of its bytes.

    .venv/bin/python tools/bench_fingerprint.py --layers 4 --hidden 1024 --vocab 16000

Builds a random-weight Llama (fp32) on the CPU, then, interleaved and best of ``--repeats``:

* ``fingerprint``: ``module_fingerprint(model, refresh=True)`` (what a connector pays once per
  model: headers + every parameter's and buffer's bytes, tensor by tensor);
* ``plain xxh3``: ``xxh3_128`` of the same bytes already packed into one contiguous buffer
  (the floor: one hash pass, no per-tensor work);
* ``cached``: ``module_fingerprint(model)`` again (the per-connector cost after the first:
  storage pointers and version counters only).
"""

from __future__ import annotations

import argparse
import time

import torch
import xxhash

from kvpool.connectors.fingerprint import module_fingerprint, module_named_tensors


def best_s(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    packed = torch.cat([t.detach().reshape(-1).view(torch.uint8) for _, t in module_named_tensors(model)]).numpy()
    mib = packed.nbytes / 2**20
    fp_s, plain_s = [], []
    for _ in range(args.repeats):  # interleaved: load from other jobs hits both sides alike
        fp_s.append(best_s(lambda: module_fingerprint(model, refresh=True), 1))
        plain_s.append(best_s(lambda: xxhash.xxh3_128_digest(packed), 1))
    module_fingerprint(model)
    cached_s = best_s(lambda: module_fingerprint(model), args.repeats)
    tensors = len(module_named_tensors(model))
    print(f"model: {tensors} tensors, {mib:.1f} MiB fp32 ({args.layers} layers, hidden {args.hidden})")
    print(f"fingerprint: {min(fp_s) * 1e3:.1f} ms = {mib / 1024 / min(fp_s):.2f} GiB/s")
    print(f"plain xxh3:  {min(plain_s) * 1e3:.1f} ms = {mib / 1024 / min(plain_s):.2f} GiB/s")
    print(f"ratio (plain / fingerprint): {min(plain_s) / min(fp_s):.2f}x")
    print(f"cached call: {cached_s * 1e6:.0f} us")


if __name__ == "__main__":
    main()
