"""Measure the reference engine (``kvpool.engine``) on this machine and fit a cost model.

    .venv/bin/python tools/sim_measure_engine.py [--out out/cost_model_ref_engine.json]
        [--rows out/ref_engine_measurements.json] [--repeats 3]

Times the reference model's real forward pass (``RefModel.forward`` over paged KV
caches, what ``Engine.step`` runs) for prefills of ``new`` tokens on top of ``cached``
ones and for decode steps of ``batch`` sequences holding ``context`` tokens in total,
takes the median of a few repeats, and fits ``kvpool.scheduler.cost_model.fit``. The
JSON it writes is a cost model ``kvpool sim --cost-model FILE`` and ``kvpool router
--cost-model FILE`` accept. Wall-clock time is the thing measured here, so this is a
tool, not a test; the fit's relative error on the measurements is printed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "out" / "cost_model_ref_engine.json"))
    ap.add_argument("--rows", default=str(ROOT / "out" / "ref_engine_measurements.json"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer, smaller shapes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 = steadier on a shared machine)")
    args = ap.parse_args()

    import torch

    from kvpool.engine.model import ModelConfig, RefModel
    from kvpool.scheduler.cost_model import fit

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cfg = ModelConfig()
    model = RefModel(cfg)
    page_tokens = 16
    max_slots = 16_384
    caches = [
        torch.zeros(2, max_slots // page_tokens, page_tokens, cfg.num_kv_heads, cfg.head_dim)
        for _ in range(cfg.num_layers)
    ]

    def timed(tokens: torch.Tensor, positions: torch.Tensor, seqs: list[tuple[int, int, torch.Tensor]]) -> float:
        model.forward(tokens, positions, seqs, caches, page_tokens)  # warm-up: first call of a shape allocates
        samples = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            model.forward(tokens, positions, seqs, caches, page_tokens)
            samples.append((time.perf_counter() - t0) * 1000.0)
        return statistics.median(samples)

    rows: list[dict[str, float | str]] = []
    news = (64, 256, 1024) if args.quick else (64, 256, 1024, 2048)
    cacheds = (0, 1024) if args.quick else (0, 1024, 4096)
    for new in news:
        for cached in cacheds:
            tokens = torch.randint(0, cfg.vocab_size, (new,))
            positions = torch.arange(cached, cached + new)
            seqs = [(0, new, torch.arange(cached + new))]
            rows.append(
                {"kind": "prefill", "new_tokens": new, "cached_tokens": cached, "ms": timed(tokens, positions, seqs)}
            )
            print(f"prefill new={new} cached={cached}: {rows[-1]['ms']:.2f} ms", file=sys.stderr)
    for batch in (1, 8, 32):
        for per_seq in (128, 512) if args.quick else (128, 512, 1024):
            if batch * per_seq > max_slots:
                continue
            tokens = torch.randint(0, cfg.vocab_size, (batch,))
            positions = torch.full((batch,), per_seq - 1)
            seqs = [(i, 1, torch.arange(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
            rows.append(
                {
                    "kind": "decode",
                    "batch": batch,
                    "context_tokens": batch * per_seq,
                    "ms": timed(tokens, positions, seqs),
                }
            )
            print(f"decode batch={batch} context={batch * per_seq}: {rows[-1]['ms']:.2f} ms", file=sys.stderr)

    spec = cfg.kv_spec(32)
    model_fit = fit(
        rows,
        name="ref-engine-cpu",
        kv_bytes_per_token=spec.bytes_per_token,
        source=f"fitted by tools/sim_measure_engine.py to kvpool.engine RefModel ({cfg.name}, "
        f"{cfg.num_layers} layers, hidden {cfg.hidden_size}) on this machine's CPU",
    )
    errs = []
    for r in rows:
        pred = (
            model_fit.prefill_ms(r["new_tokens"], r["cached_tokens"])
            if r["kind"] == "prefill"
            else model_fit.decode_step_ms(r["batch"], r["context_tokens"])
        )
        errs.append(abs(pred - float(r["ms"])) / float(r["ms"]))
    for path, doc in ((args.rows, rows), (args.out, model_fit.to_dict())):
        p = pathlib.Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(doc, indent=1))
    print(json.dumps(model_fit.to_dict(), indent=1))
    print(
        f"fit: median relative error {statistics.median(errs):.1%}, max {max(errs):.1%} over {len(rows)} "
        f"measurements; wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
