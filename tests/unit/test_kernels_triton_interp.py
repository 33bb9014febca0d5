"""The Triton gather/scatter kernels, run by Triton's CPU interpreter, against the torch reference.

No GPU here: ``TRITON_INTERPRET=1`` makes Triton execute the kernels with numpy on CPU tensors.
It must be set before triton is imported, so the cases run in one child process (this file run
as a script) and the variable never reaches the pytest process or other tests. Each case
compares bits (raw integer views, so NaN sentinels and fp8 compare exactly) with the CPU
``strategy="auto"`` path of ``kvpool.kernels.paged`` and with a per-token oracle written here:
the gathered blocks (heads outside the TP range must keep their sentinel) and, after a scatter
into sentinel-filled caches, every byte of every cache (pages and tokens not covered must be
untouched). Tiny shapes: the interpreter is slow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.core.spec import KVSpec
from kvpool.kernels import paged
from kvpool.kernels.paged import PagedLayout, gather_blocks, scatter_blocks

ROOT = Path(__file__).resolve().parents[2]
DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "int8"]
_RAW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Case:
    """One gather + scatter through the Triton kernels."""

    order: str
    page_tokens: int
    block_tokens: int
    num_blocks: int
    model_heads: int  # kv heads of the pool spec
    head_start: int  # this rank's head range [head_start, head_start + heads)
    heads: int
    dtype: str
    head_dim: int = 8
    layers: int = 2
    kind: str = "mha"
    strided: bool = False  # caches and blocks are non-contiguous views
    out_dtype: str = ""  # gather into blocks of another dtype (converted after the kernel)

    @property
    def id(self) -> str:
        parts = [
            self.order,
            f"p{self.page_tokens}b{self.block_tokens}n{self.num_blocks}",
            f"h{self.head_start}+{self.heads}of{self.model_heads}",
            self.dtype,
            f"d{self.head_dim}",
        ]
        if self.kind != "mha":
            parts.append(self.kind)
        if self.strided:
            parts.append("strided")
        if self.out_dtype:
            parts.append(f"to-{self.out_dtype}")
        return "-".join(parts)


def _cases() -> list[Case]:
    """Orders x page/block sizes (pages per block 1, 2, 4; two blocks per page with a partial
    last page) x head ranges (whole model, TP=2 rank 1, TP=4 rank 1), the dtype cycling; then
    every dtype on one shape, and the odd ones out."""
    sizes = [(4, 8, 3), (8, 8, 3), (2, 8, 2), (8, 4, 3)]
    head_ranges = [(2, 0, 2), (4, 2, 2), (4, 1, 1)]
    cases = []
    i = 0
    for order in ("NHD", "HND"):
        for p, t, n in sizes:
            for model_heads, h0, hn in head_ranges:
                cases.append(Case(order, p, t, n, model_heads, h0, hn, DTYPES[i % len(DTYPES)]))
                i += 1
    cases += [Case("NHD", 4, 8, 2, 2, 1, 1, d) for d in DTYPES]
    cases += [
        Case("NHD", 4, 8, 2, 2, 0, 2, "float32", head_dim=6),  # head_dim not a power of 2: masked lanes
        Case("HND", 16, 64, 2, 1, 0, 1, "bfloat16", head_dim=128),  # several token tiles per block
        Case("NHD", 4, 8, 3, 1, 0, 1, "bfloat16", kind="mla"),  # one latent per layer, no K|V pair
        Case("NHD", 4, 8, 3, 4, 2, 2, "float16", strided=True),
        Case("HND", 8, 4, 3, 4, 0, 2, "bfloat16", strided=True),
        Case("HND", 4, 8, 2, 2, 0, 2, "bfloat16", out_dtype="float32"),
    ]
    return cases


CASES = _cases()


# ---------------------------------------------------------------- child process (interpreter on)


def _raw(x: torch.Tensor) -> torch.Tensor:
    return x.view(_RAW[x.element_size()])


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    return (torch.randn(shape, generator=gen) * 4).to(dtype)


def _sentinel(shape: tuple[int, ...], dtype: torch.dtype, strided: bool) -> torch.Tensor:
    """Every element's bits set to -3 (a NaN for the float types); strided: a view of every
    other element of the last dim of a twice-as-wide tensor."""
    wide = (*shape[:-1], shape[-1] * 2) if strided else shape
    x = torch.empty(wide, dtype=dtype)
    _raw(x).fill_(-3)
    return x[..., ::2] if strided else x


def _oracle_index(case: Case, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, slot) of each of the request's tokens, token i at page table[i // P], slot i % P."""
    tok = torch.arange(case.num_blocks * case.block_tokens)
    return table[tok // case.page_tokens], tok % case.page_tokens


def _oracle_gather(case: Case, caches: list[torch.Tensor], table: torch.Tensor, out: torch.Tensor) -> None:
    page, slot = _oracle_index(case, table)
    n, t, h0, hn = case.num_blocks, case.block_tokens, case.head_start, case.heads
    for layer, cache in enumerate(caches):
        tokens_first = cache if case.order == "NHD" else cache.transpose(2, 3)  # [kv, pages, P, hn, d]
        rows = tokens_first[:, page, slot]  # [kv, tok, hn, d]
        per_block = rows.unflatten(1, (n, t)).permute(1, 0, 3, 2, 4)  # [n, kv, hn, t, d]
        _raw(out)[:n, layer, :, h0 : h0 + hn] = _raw(per_block)


def _oracle_scatter(case: Case, blocks: torch.Tensor, caches: list[torch.Tensor], table: torch.Tensor) -> None:
    page, slot = _oracle_index(case, table)
    n, h0, hn = case.num_blocks, case.head_start, case.heads
    for layer, cache in enumerate(caches):
        src = blocks[:n, layer, :, h0 : h0 + hn].permute(1, 0, 3, 2, 4).flatten(1, 2)  # [kv, tok, hn, d]
        tokens_first = cache if case.order == "NHD" else cache.transpose(2, 3)  # a view: writes land in cache
        _raw(tokens_first)[:, page, slot] = _raw(src)


def run_case(case: Case, seed: int) -> str:
    """'' when the Triton kernels give the reference's bits, else what differed.

    Reference: the CPU torch path ("auto"; "staged" when the blocks have another dtype) and the
    per-token oracle above."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    spec = KVSpec("m", case.layers, case.model_heads, case.head_dim, case.dtype, case.block_tokens, kind=case.kind)
    layout = PagedLayout(case.page_tokens, case.heads, case.head_dim, case.order, head_start=case.head_start)
    ntok = case.num_blocks * case.block_tokens
    req_pages = -(-ntok // case.page_tokens)
    num_pages = req_pages + 3
    table = torch.randperm(num_pages, generator=gen)[:req_pages]
    shape = layout.page_shape(spec.kv_factor, num_pages)
    caches = []
    for _ in range(case.layers):
        cache = _sentinel(shape, dtype, case.strided)
        cache.copy_(_random(shape, dtype, gen))
        caches.append(cache)
    problems = []

    out_dtype = getattr(torch, case.out_dtype) if case.out_dtype else dtype
    block_shape = (case.num_blocks, *spec.block_shape)
    got = _sentinel(block_shape, out_dtype, case.strided)
    want = _sentinel(block_shape, out_dtype, case.strided)
    gather_blocks(spec, layout, caches, table, got, case.num_blocks, strategy="triton")
    # the CPU "auto" paths gather only into blocks of the cache's dtype; "staged" converts
    reference = "staged" if case.out_dtype else "auto"
    gather_blocks(spec, layout, caches, table, want, case.num_blocks, strategy=reference)
    if not torch.equal(_raw(got), _raw(want)):
        problems.append("gather != CPU reference")
    if not case.out_dtype:
        oracle = _sentinel(block_shape, dtype, False)
        _oracle_gather(case, caches, table, oracle)
        if not torch.equal(_raw(got), _raw(oracle)):
            problems.append("gather != per-token oracle")

    blocks = _sentinel(block_shape, dtype, case.strided)
    blocks.copy_(_random(block_shape, dtype, gen))
    back_got = [_sentinel(shape, dtype, case.strided) for _ in caches]
    back_want = [_sentinel(shape, dtype, case.strided) for _ in caches]
    back_oracle = [_sentinel(shape, dtype, False) for _ in caches]
    scatter_blocks(spec, layout, blocks, back_got, table, case.num_blocks, strategy="triton")
    scatter_blocks(spec, layout, blocks, back_want, table, case.num_blocks, strategy="auto")
    _oracle_scatter(case, blocks, back_oracle, table)
    if not all(torch.equal(_raw(a), _raw(b)) for a, b in zip(back_got, back_want, strict=True)):
        problems.append("scatter != CPU reference")
    if not all(torch.equal(_raw(a), _raw(b)) for a, b in zip(back_got, back_oracle, strict=True)):
        problems.append("scatter != per-token oracle")
    return "; ".join(problems)


def child_main() -> None:
    """Run every case under the interpreter; print one JSON object {case id: problem or ''}."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    from kvpool.kernels import paged_triton

    results: dict[str, Any] = {
        "interpreting": paged_triton.interpreting(),
        # CPU "auto" must never take the kernels, even where they could run
        "cpu_auto_uses_triton": paged._use_triton("auto", torch.zeros(1)),
    }
    for seed, case in enumerate(CASES):
        try:
            results[case.id] = run_case(case, seed)
        except Exception as exc:  # reported per case by the parent
            results[case.id] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(results))


# ---------------------------------------------------------------- parent (pytest, interpreter off)


@pytest.fixture(scope="module")
def interp_results() -> dict[str, Any]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, __file__],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results


def test_child_ran_under_the_interpreter_and_cpu_auto_stays_on_torch(interp_results: dict[str, Any]) -> None:
    assert interp_results["interpreting"] is True
    assert interp_results["cpu_auto_uses_triton"] is False


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_triton_kernels_equal_torch_reference(case: Case, interp_results: dict[str, Any]) -> None:
    assert interp_results[case.id] == "", f"{asdict(case)}: {interp_results[case.id]}"


def test_module_imports_and_cpu_paths_work_without_triton() -> None:
    """With triton unimportable, ``paged`` still imports and gathers on CPU, "auto" never
    reaches for the kernels, and asking for "triton" is refused with a typed error."""
    script = """
import sys
sys.modules["triton"] = None  # import triton -> ImportError, find_spec -> None
import torch
from kvpool.core.errors import InvalidArgument
from kvpool.core.spec import KVSpec
from kvpool.kernels import paged_triton
from kvpool.kernels.paged import PagedLayout, gather_blocks
assert not paged_triton.installed() and not paged_triton.available(torch.device("cpu"))
spec = KVSpec("m", 1, 2, 4, "float32", 4)
layout = PagedLayout(4, 2, 4)
cache = torch.randn(layout.page_shape(2, 3))
out = torch.zeros(1, *spec.block_shape)
gather_blocks(spec, layout, [cache], [2], out, 1)
assert torch.equal(out[0, 0], cache[:, 2].permute(0, 2, 1, 3))
try:
    gather_blocks(spec, layout, [cache], [2], out, 1, strategy="triton")
except InvalidArgument as exc:
    assert "triton" in str(exc)
else:
    raise AssertionError("strategy='triton' ran without triton")
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


if __name__ == "__main__":
    child_main()
