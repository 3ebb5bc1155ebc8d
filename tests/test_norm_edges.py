"""Eagerly, the gradient through a hand-written norm alone is read on the autograd edges from
the norm's own nodes into its input (capture/norm_edges.py): the norm runs once per call, the
rows equal autograd through the norm alone, and training is bit-identical to a plain copy's.
A norm whose graph is too long to walk is run again alone instead, and is as exact. So are
torch's ``nn.RMSNorm`` and gradscope's ScaleNorm eagerly in fp32 (whose closed form is kept
for traced calls)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradscope
from gradscope.models.norms import ScaleNorm
from recorder_ref import norm_gains, site_gradients

D, T, B = 32, 6, 3


class CountedRMSNorm(nn.Module):
    """An RMSNorm as people write it (fp32 inside, cast back), counting its forward calls."""

    def __init__(self, d: int):
        super().__init__()
        self.weight, self.calls = nn.Parameter(torch.ones(d)), 0

    def forward(self, x):
        self.calls += 1
        xf = x.float()
        return (xf * torch.rsqrt(self.mean_square(xf) + 1e-6)).type_as(x) * self.weight

    def mean_square(self, xf):
        return xf.pow(2).mean(-1, keepdim=True)


class LoopRMSNorm(CountedRMSNorm):
    """The same norm with its mean square summed feature by feature: ≈100 autograd nodes, more
    than the edge walk follows (capture/norm_edges.py), so it is run again alone."""

    def mean_square(self, xf):
        return sum(xf[..., i:i + 1] * xf[..., i:i + 1] for i in range(xf.shape[-1])) / xf.shape[-1]


class Net(nn.Module):
    """Takes its input tensor straight into a norm (a leaf: its edge goes to an AccumulateGrad)."""

    def __init__(self, norm):
        super().__init__()
        self.n_in, self.fc, self.n_mid, self.fc2, self.n_out = norm(D), nn.Linear(D, D), norm(D), nn.Linear(D, D), norm(D)

    def forward(self, x, target):
        h = x + self.fc(self.n_in(x))
        h = h + self.fc2(torch.tanh(self.n_mid(h)))
        return ((self.n_out(h) - target) ** 2).mean()


class CountedTorchRMSNorm(nn.RMSNorm):
    """torch's RMSNorm (a closed form is known for it), counting its forward calls."""

    def __init__(self, d: int):
        super().__init__(d, eps=1e-6)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


class CountedScaleNorm(ScaleNorm):
    """gradscope's ScaleNorm (g·x/max(‖x‖, eps), a closed form is known), counting its calls."""

    def __init__(self, d: int):
        super().__init__(d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


COUNTED = (CountedRMSNorm, CountedTorchRMSNorm, CountedScaleNorm)


def _norms(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, COUNTED)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("norm", [CountedRMSNorm, LoopRMSNorm, CountedTorchRMSNorm, CountedScaleNorm],
                         ids=["walked", "too_long_to_walk", "torch_rmsnorm", "scalenorm"])
def test_norm_rows_are_exact_the_norm_runs_once_when_walked_and_training_is_unchanged(norm, precision):
    torch.manual_seed(0)
    model = Net(norm)
    plain, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt, opt_plain = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, plain))
    rec = gradscope.Recorder(model, optimizer=opt)
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    data = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(B, T, D, generator=data).requires_grad_()
        target = torch.randn(B, T, D, generator=data)
        ref.load_state_dict(model.state_dict())

        def ref_loss():
            with cast:
                return ref(x, target)

        want_in, want_gain = {}, {}
        for n, m in _norms(ref).items():
            want_in.update(site_gradients(ref, {f"{n}.in": (m, "input")}, ref_loss)[0])
            want_gain.update(norm_gains(ref, {n: m}, ref_loss))
        calls = {n: m.calls for n, m in _norms(model).items()}
        with rec.step(step):
            with cast:
                loss = model(x, target)
            loss.backward()
        ran = {n: m.calls - calls[n] for n, m in _norms(model).items()}
        assert ran == {n: 2 if norm is LoopRMSNorm else 1 for n in ran}, ran  # run again only when not walked
        with cast:
            loss_plain = plain(x, target)
        loss_plain.backward()
        for o in (opt, opt_plain):
            o.step()
            o.zero_grad(set_to_none=True)
        got = rec.frame().query("step == @step").set_index(["quantity", "site"]).value
        for site, want in want_in.items():
            assert ("act_grad_norm", site) in got.index, (step, site)
            assert abs(got["act_grad_norm", site] / want - 1) <= 1e-6, (step, site, got["act_grad_norm", site], want)
        for n, want in want_gain.items():
            assert abs(got["ln_gain", n] / want - 1) <= 1e-6, (step, n, got["ln_gain", n], want)
    rec.close()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), f"{name}: training with the recorder differs from the plain copy's"


def test_a_kept_graph_run_backward_twice_reads_the_edges_twice():
    """``retain_graph=True``: the second backward through the same norm nodes reads their
    edges afresh, so the step holds √(‖g₁‖² + ‖g₂‖²) (docs/recording.md: two backwards through
    one forward are one micro-step), here √2·‖g‖ with g from autograd."""
    torch.manual_seed(0)
    model = Net(CountedRMSNorm)
    ref = copy.deepcopy(model)
    x, target = torch.randn(B, T, D).requires_grad_(), torch.randn(B, T, D)
    rec = gradscope.Recorder(model)
    with rec.step(0):
        loss = model(x, target)
        loss.backward(retain_graph=True)
        loss.backward()
    got = rec.frame().set_index(["quantity", "site"]).value
    rec.close()
    for n in ("n_in", "n_mid", "n_out"):
        m = getattr(ref, n)
        want = site_gradients(ref, {f"{n}.in": (m, "input")}, lambda: ref(x, target))[0][f"{n}.in"]
        assert abs(got["act_grad_norm", f"{n}.in"] / (2 ** 0.5 * want) - 1) <= 1e-6, n
