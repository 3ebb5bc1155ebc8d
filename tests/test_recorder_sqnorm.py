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


def test_a_sparse_gradient_is_reduced_over_its_coalesced_values():
    """nn.Embedding(sparse=True) leaves a sparse COO gradient with repeated rows."""
    g = torch.Generator().manual_seed(3)
    idx = torch.tensor([[0, 5, 5, 9], [1, 2, 2, 3]])  # (5, 2) twice: summed before squaring
    t = torch.sparse_coo_tensor(idx, torch.randn(4, generator=g), (10, 4))
    want = _fp64(t.to_dense())
    assert abs(squared_norm(t).item() / want - 1) < 1e-6
    got = squared_norms([torch.randn(DOT_MIN, generator=g), t])
    assert abs(got[1].item() / want - 1) < 1e-6


def test_a_model_with_a_sparse_embedding_records_its_parameter_gradient_norms():
    import gradscope

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 8, sparse=True)
            self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])

        def forward(self, x):
            h = self.emb(x)
            for layer in self.layers:
                h = h + torch.tanh(layer(h))
            return h.pow(2).sum()

    torch.manual_seed(0)
    model, x = Net(), torch.randint(0, 50, (4, 6))
    with gradscope.record(model) as rec:
        model(x).backward()
    df = rec.frame()
    total = df[(df.quantity == "param_grad_norm") & (df.site == "")].value.item()
    want = sum(_fp64(p.grad.to_dense()) for p in model.parameters()) ** 0.5
    assert abs(total / want - 1) < 1e-5
