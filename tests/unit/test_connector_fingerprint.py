"""Weight fingerprints (kvpool.connectors.fingerprint): exact, order-free, cached per module."""

from __future__ import annotations

import pytest
import torch

from kvpool.connectors.fingerprint import (
    FINGERPRINT_SCHEME,
    is_fingerprint,
    module_fingerprint,
    tensors_fingerprint,
)
from kvpool.core.errors import InvalidArgument


def named(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [("a", torch.randn(4, 3, generator=gen)), ("b", torch.randn(5, generator=gen).to(torch.bfloat16))]


def test_every_bit_name_shape_dtype_and_extra_counts() -> None:
    base = tensors_fingerprint(named())
    assert is_fingerprint(base) and base.startswith(FINGERPRINT_SCHEME + ":") and not is_fingerprint("v1.2")
    assert tensors_fingerprint(named()) == base
    assert tensors_fingerprint(list(reversed(named()))) == base  # name order, not registration order
    flipped = named()
    flipped[1][1].view(torch.int16)[2] ^= 1  # one bit of a bf16 element
    assert tensors_fingerprint(flipped) != base
    renamed = [("a", named()[0][1]), ("c", named()[1][1])]
    assert tensors_fingerprint(renamed) != base
    reshaped = [("a", named()[0][1].reshape(3, 4)), named()[1]]
    assert tensors_fingerprint(reshaped) != base
    retyped = [named()[0], ("b", named()[1][1].float())]
    assert tensors_fingerprint(retyped) != base
    assert tensors_fingerprint(named(), extra=b"rms_eps=1e-6") != base
    assert tensors_fingerprint(named()[:1]) != base
    non_contiguous = [("a", named()[0][1].t().contiguous().t()), named()[1]]
    assert tensors_fingerprint(non_contiguous) == base  # same values, other strides


def test_refused_inputs() -> None:
    with pytest.raises(InvalidArgument, match="unique"):
        tensors_fingerprint([("a", torch.ones(2)), ("a", torch.zeros(2))])
    with pytest.raises(InvalidArgument, match="meta"):
        tensors_fingerprint([("w", torch.empty(3, device="meta"))])


def test_module_cache_reused_until_a_tensor_changes() -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    first = module_fingerprint(module)
    assert module_fingerprint(module) == first
    with torch.no_grad():
        module[0].weight[0, 0] += 1.0
    second = module_fingerprint(module)
    assert second != first
    module.load_state_dict({k: v.clone() for k, v in module.state_dict().items()})  # same values, new bytes copied
    assert module_fingerprint(module) == second
    module[0].weight.data[0, 0] += 1.0  # invisible to the version counter: refresh sees it
    assert module_fingerprint(module, refresh=True) != second
    assert module_fingerprint(module, extra=b"x") != module_fingerprint(module)


def test_tied_parameters_hashed_once() -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    tied = torch.nn.ModuleDict({"emb": emb, "head": head})
    assert len(list(tied.named_parameters())) == 1
    module_fingerprint(tied)  # no duplicate-name error
