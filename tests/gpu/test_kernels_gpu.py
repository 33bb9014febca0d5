"""The kernels on CUDA tensors match the CPU reference bit for bit (skipped without CUDA).

Two GPU paths: the torch code of ``kvpool.kernels.paged`` running on device tensors
("staged") and the Triton kernels of ``kvpool.kernels.paged_triton`` ("triton", what "auto"
takes on CUDA when triton is installed). Both must give the CPU reference's bytes: page sizes
both ways, NHD/HND, TP head ranges, every KV dtype, non-contiguous tensors, and (when the GPU has
room) a cache over 2**31 elements, where 32-bit address arithmetic would go wrong.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvpool.core.spec import KVSpec
from kvpool.kernels import paged_triton
from kvpool.kernels.paged import PagedLayout, gather_blocks, scatter_blocks
from kvpool.kernels.quant import compress, decompress, error_bound

DEVICE = "cuda"
HAS_TRITON = importlib.util.find_spec("triton") is not None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STRATEGIES = [
    "auto",
    "staged",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")),
]
_RAW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(x: torch.Tensor) -> torch.Tensor:
    return x.view(_RAW[x.element_size()])


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype in (torch.int8, torch.uint8):
        return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8).view(dtype)
    return (torch.randn(shape, generator=gen) * 4).to(dtype)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gather_scatter_cuda_equals_cpu(order: str, dtype: str, strategy: str) -> None:
    spec = KVSpec("m", 4, 8, 64, dtype, 32)
    layout = PagedLayout(16, 4, 64, order, head_start=4)
    tdtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    cpu = [torch.randn(layout.page_shape(2, 40), generator=gen).to(tdtype) for _ in range(4)]
    table = torch.randperm(40, generator=gen)[:20]
    ref = torch.zeros(10, *spec.block_shape, dtype=tdtype)
    gather_blocks(spec, layout, cpu, table, ref, 10)
    dev = [c.to(DEVICE) for c in cpu]
    got = torch.zeros_like(ref).to(DEVICE)
    gather_blocks(spec, layout, dev, table.to(DEVICE), got, 10, strategy=strategy)
    assert torch.equal(got.cpu(), ref)
    back = [torch.zeros_like(c) for c in dev]
    scatter_blocks(spec, layout, got, back, table.to(DEVICE), 10, strategy=strategy)
    cpu_back = [torch.zeros_like(c) for c in cpu]
    scatter_blocks(spec, layout, ref, cpu_back, table, 10)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(back, cpu_back))


# (page_tokens, block_tokens, num_blocks, model heads, head_start, heads, head_dim, dtype, strided)
SHAPES = [
    (16, 64, 5, 8, 0, 8, 128, "bfloat16", False),  # 4 pages per block, whole model
    (16, 16, 7, 8, 2, 2, 128, "float16", False),  # TP=4 rank 1
    (32, 16, 5, 4, 2, 2, 64, "bfloat16", False),  # 2 blocks per page, last page half covered
    (16, 32, 3, 2, 1, 1, 80, "float32", False),  # head_dim not a power of 2
    (16, 32, 4, 4, 0, 4, 128, "float8_e4m3fn", False),  # raw bytes
    (16, 32, 4, 4, 2, 2, 128, "int8", True),  # non-contiguous caches and blocks
]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"p{s[0]}b{s[1]}-h{s[4]}+{s[5]}-{s[7]}" for s in SHAPES])
def test_triton_matches_cpu_reference_bytes(
    order: str, shape: tuple[int, int, int, int, int, int, int, str, bool]
) -> None:
    """Triton gather and scatter on CUDA against the CPU "auto" path, every byte compared:
    heads outside the rank's range keep their sentinel, and so do pages (and the uncovered
    tokens of a shared page) that the scatter does not own."""
    p, t, n, model_heads, h0, hn, d, dtype_name, strided = shape
    dtype = getattr(torch, dtype_name)
    layers = 3
    spec = KVSpec("m", layers, model_heads, d, dtype_name, t)
    layout = PagedLayout(p, hn, d, order, head_start=h0)
    gen = torch.Generator().manual_seed(1)
    req_pages = -(-n * t // p)
    num_pages = req_pages + 5
    table = torch.randperm(num_pages, generator=gen)[:req_pages]

    def sentinel(shape: tuple[int, ...], device: str) -> torch.Tensor:
        wide = (*shape[:-1], shape[-1] * 2) if strided else shape
        x = torch.empty(wide, dtype=dtype, device=device)
        _raw(x).fill_(-3)
        return x[..., ::2] if strided else x

    page_shape = layout.page_shape(2, num_pages)
    cpu = [_random(page_shape, dtype, gen) for _ in range(layers)]
    dev = []
    for c in cpu:
        x = sentinel(page_shape, DEVICE)
        x.copy_(c.to(DEVICE))
        dev.append(x)
    block_shape = (n, *spec.block_shape)
    want = sentinel(block_shape, "cpu")
    gather_blocks(spec, layout, cpu, table, want, n)
    got = sentinel(block_shape, DEVICE)
    gather_blocks(spec, layout, dev, table.to(DEVICE), got, n, strategy="triton")
    torch.cuda.synchronize()
    assert torch.equal(_raw(got).cpu(), _raw(want))

    blocks = _random(block_shape, dtype, gen)
    cpu_back = [sentinel(page_shape, "cpu") for _ in range(layers)]
    scatter_blocks(spec, layout, blocks, cpu_back, table, n)
    dev_blocks = sentinel(block_shape, DEVICE)
    dev_blocks.copy_(blocks.to(DEVICE))
    dev_back = [sentinel(page_shape, DEVICE) for _ in range(layers)]
    scatter_blocks(spec, layout, dev_blocks, dev_back, table.to(DEVICE), n, strategy="triton")
    torch.cuda.synchronize()
    assert all(torch.equal(_raw(a).cpu(), _raw(b)) for a, b in zip(dev_back, cpu_back, strict=True))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_auto_on_cuda_takes_the_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def counted(name: str, real: Callable[..., None]) -> Callable[..., None]:
        def run(*args: Any, **kwargs: Any) -> None:
            calls.append(name)
            real(*args, **kwargs)

        return run

    monkeypatch.setattr(paged_triton, "gather", counted("gather", paged_triton.gather))
    monkeypatch.setattr(paged_triton, "scatter", counted("scatter", paged_triton.scatter))
    spec = KVSpec("m", 2, 2, 64, "bfloat16", 16)
    layout = PagedLayout(16, 2, 64)
    caches = [torch.randn(layout.page_shape(2, 4), device=DEVICE).to(torch.bfloat16) for _ in range(2)]
    out = torch.zeros(2, *spec.block_shape, dtype=torch.bfloat16, device=DEVICE)
    gather_blocks(spec, layout, caches, [3, 1], out, 2)
    scatter_blocks(spec, layout, out, caches, [0, 2], 2)
    assert calls == ["gather", "scatter"]
    for cache in caches:  # block 0 (page 3) went to page 0, block 1 (page 1) to page 2
        assert torch.equal(cache[:, 0], cache[:, 3]) and torch.equal(cache[:, 2], cache[:, 1])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_addresses_a_cache_over_2_pow_31_elements() -> None:
    """One int8 layer of 66,000 NHD pages of 16 x 8 x 128 = 2.16e9 elements: pages near the end
    lie past 2**31 elements, where 32-bit offsets would wrap."""
    num_pages = 66_000
    need = 2 * num_pages * 16 * 8 * 128 * 2 + (1 << 30)  # the cache, a copy for the scatter check, slack
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    spec = KVSpec("m", 1, 8, 128, "int8", 32)
    layout = PagedLayout(16, 8, 128)
    cache = torch.zeros(layout.page_shape(2, num_pages), dtype=torch.int8, device=DEVICE)
    assert cache.numel() > 2**31
    table = torch.tensor([num_pages - 1, 5, num_pages - 2, num_pages - 3], device=DEVICE)
    gen = torch.Generator().manual_seed(2)
    for page in table.tolist():
        cache[:, page] = torch.randint(-128, 128, (2, 16, 8, 128), generator=gen, dtype=torch.int8).to(DEVICE)
    out = torch.zeros(2, *spec.block_shape, dtype=torch.int8, device=DEVICE)
    gather_blocks(spec, layout, [cache], table, out, 2, strategy="triton")
    for b in range(2):
        pages = cache[:, table[2 * b : 2 * b + 2]]  # [kv, 2, 16, h, d]
        assert torch.equal(out[b, 0], pages.flatten(1, 2).permute(0, 2, 1, 3))
    copy = cache.clone()
    cache[:, table] = 0
    scatter_blocks(spec, layout, out, [cache], table, 2, strategy="triton")
    assert torch.equal(cache, copy)


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_quant_cuda_within_bound(codec: str) -> None:
    x = torch.randn(4, 2, 2, 8, 32, 64, device=DEVICE) * 3
    y = decompress(compress(x, codec), torch.float32)
    assert bool(((x - y).abs() <= error_bound(x, codec) * (1 + 1e-5) + 1e-30).all())
