"""int8/fp8 transfer compression stays inside its documented error bound."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.errors import InvalidArgument
from kvpool.kernels.quant import CODECS, compress, decompress, error_bound

torch.set_num_threads(1)


@settings(max_examples=40, deadline=None)
@given(
    codec=st.sampled_from(CODECS),
    seed=st.integers(0, 2**16),
    magnitude=st.sampled_from([1e-3, 1.0, 50.0, 3e4]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_roundtrip_within_documented_bound(codec: str, seed: int, magnitude: float, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 2, 2, 3, 8, 4, generator=gen) * magnitude * torch.rand(2, 2, 2, 3, 1, 1, generator=gen)).to(
        dtype
    )
    packed = compress(x, codec)
    y = decompress(packed, torch.float32)
    err = (x.float() - y).abs()
    assert bool((err <= error_bound(x, codec) * (1 + 1e-5) + 1e-30).all())
    assert packed.nbytes < x.numel() * x.element_size() or x.element_size() == 1
    assert decompress(packed).dtype == dtype


def test_zero_groups_and_outlier_heads_are_independent() -> None:
    x = torch.zeros(1, 1, 2, 2, 4, 4)
    x[0, 0, 0, 1] = 1000.0  # one outlier head
    x[0, 0, 1, 0] = torch.linspace(-1, 1, 16).view(4, 4)
    for codec in CODECS:
        y = decompress(compress(x, codec), torch.float32)
        assert torch.equal(y[0, 0, 0, 0], torch.zeros(4, 4))
        assert (y[0, 0, 1, 0] - x[0, 0, 1, 0]).abs().max() < 0.07  # not crushed by the other head's scale


def test_bad_codec_and_integer_input_refused() -> None:
    with pytest.raises(InvalidArgument):
        compress(torch.zeros(1, 1, 1, 1, 1, 1), "int4")
    with pytest.raises(InvalidArgument):
        compress(torch.zeros(1, 1, 1, 1, 1, 1, dtype=torch.int8), "int8")
