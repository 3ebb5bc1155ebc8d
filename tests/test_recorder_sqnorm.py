"""The recorder's one reduction (gradscope/recorder/sqnorm.py) against an fp64 sum computed here."""

from __future__ import annotations

import pytest
import torch

from gradscope.recorder.sqnorm import DOT_MIN, squared_norm, squared_norms


def _fp64(t: torch.Tensor) -> float:
    return t.double().pow(2).sum().item()


@pytest.mark.parametrize("case", ["contiguous", "transposed", "bf16", "long", "requires_grad"])
def test_squared_norm_equals_an_fp64_sum(case):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(64, 48, generator=g) * 3 + 1
    if case == "transposed":  # strided: the vector_norm path
        t = t.t()
    elif case == "bf16":
        t = t.bfloat16()
    elif case == "long":  # 4 M floats: where an fp32 running sum drifts
        t = torch.randn(4_000_000, generator=g) * 3 + 1
    elif case == "requires_grad":
        t = t.requires_grad_()
    got = squared_norm(t)
    assert got.dtype == torch.float32 and got.dim() == 0 and not got.requires_grad
    assert abs(got.item() / _fp64(t) - 1) < 1e-5, case


def test_squared_norms_keeps_the_order_of_large_and_small_tensors():
    g = torch.Generator().manual_seed(1)
    sizes = [DOT_MIN * 2, 7, DOT_MIN, 300, DOT_MIN - 1, DOT_MIN * 3, 1]
    tensors = [torch.randn(n, generator=g) * (i + 1) for i, n in enumerate(sizes)]
    got = squared_norms(tensors)
    assert got.shape == (len(sizes),) and got.dtype == torch.float32
    for i, t in enumerate(tensors):
        assert abs(got[i].item() / _fp64(t) - 1) < 1e-5, f"tensor {i} ({t.numel()} elements)"


def test_squared_norms_of_mixed_dtypes_and_layouts():
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(DOT_MIN * 2, generator=g), torch.randn(40, 50, generator=g).t(),
               torch.randn(DOT_MIN * 2, generator=g).bfloat16()]
    got = squared_norms(tensors)
    for i, t in enumerate(tensors):
        assert abs(got[i].item() / _fp64(t) - 1) < 1e-5, f"tensor {i}"
