"""Cost-model profiling of the reference engine: one sample per point, timed by the injected clock."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvpool.core.errors import InvalidArgument
from kvpool.engine.model import ModelConfig
from kvpool.engine.profile import DecodeSample, PrefillSample, profile_decode, profile_prefill

torch.set_num_threads(1)
MC = ModelConfig(vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)


def stepping_clock() -> object:
    ticks = itertools.count()
    return lambda: float(next(ticks))  # every read advances one second: each forward "takes" 1 s


def test_prefill_and_decode_samples_per_point() -> None:
    pre = profile_prefill(MC, [(16, 0), (8, 40)], repeats=2, clock_s=stepping_clock())  # type: ignore[arg-type]
    assert pre == [PrefillSample(16, 0, 1.0), PrefillSample(8, 40, 1.0)]
    dec = profile_decode(MC, [(1, 10), (3, 33)], clock_s=stepping_clock())  # type: ignore[arg-type]
    assert dec == [DecodeSample(1, 10, 1.0), DecodeSample(3, 33, 1.0)]


def test_bad_points_refused() -> None:
    with pytest.raises(InvalidArgument):
        profile_prefill(MC, [(0, 5)])
    with pytest.raises(InvalidArgument):
        profile_decode(MC, [(2, 0)])
    with pytest.raises(InvalidArgument):
        profile_decode(MC, [(1, 1)], repeats=0)
