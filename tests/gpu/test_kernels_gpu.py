"""The kernels on CUDA tensors match the CPU reference bit for bit (skipped without CUDA).

The GPU path is the same torch code running on device tensors (no Triton/CUDA kernel is
shipped yet); these tests pin that it stays correct there.
"""

from __future__ import annotations

import pytest
import torch

from kvpool.core.spec import KVSpec
from kvpool.kernels.paged import PagedLayout, gather_blocks, scatter_blocks
from kvpool.kernels.quant import compress, decompress, error_bound

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gather_scatter_cuda_equals_cpu(order: str, dtype: str) -> None:
    spec = KVSpec("m", 4, 8, 64, dtype, 32)
    layout = PagedLayout(16, 4, 64, order, head_start=4)
    tdtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    cpu = [torch.randn(layout.page_shape(2, 40), generator=gen).to(tdtype) for _ in range(4)]
    table = torch.randperm(40, generator=gen)[:20]
    ref = torch.zeros(10, *spec.block_shape, dtype=tdtype)
    gather_blocks(spec, layout, cpu, table, ref, 10)
    dev = [c.cuda() for c in cpu]
    got = torch.zeros_like(ref).cuda()
    gather_blocks(spec, layout, dev, table.cuda(), got, 10)
    assert torch.equal(got.cpu(), ref)
    back = [torch.zeros_like(c) for c in dev]
    scatter_blocks(spec, layout, got, back, table.cuda(), 10)
    cpu_back = [torch.zeros_like(c) for c in cpu]
    scatter_blocks(spec, layout, ref, cpu_back, table, 10)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(back, cpu_back))


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_quant_cuda_within_bound(codec: str) -> None:
    x = torch.randn(4, 2, 2, 8, 32, 64, device="cuda") * 3
    y = decompress(compress(x, codec), torch.float32)
    assert bool(((x - y).abs() <= error_bound(x, codec) * (1 + 1e-5) + 1e-30).all())
