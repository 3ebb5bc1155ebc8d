"""The checks of a step whose rows wait (built after the first steps, from kept keys and
slot lists) still see what changed: a site that stops being called, a site whose gradient
stops arriving, and the rows follow autograd step by step. References: autograd on a copy
of the model (retain_grad on each block's output)."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

import gradscope
from tests.twin_models import TwinBlock


class Net(nn.Module):
    """Three residual blocks; ``skip`` leaves the last one out; ``frozen`` computes the
    first under ``torch.no_grad`` (its output then has no gradient)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([TwinBlock() for _ in range(3)])

    def forward(self, x, skip: bool = False, frozen: bool = False):
        if frozen:
            with torch.no_grad():
                x = self.blocks[0](x)
        else:
            x = self.blocks[0](x)
        x = self.blocks[1](x)
        return x if skip else self.blocks[2](x)


SITES = {"blocks.0.out": "blocks.0", "blocks.1.out": "blocks.1", "blocks.2.out": "blocks.2"}
# (skip, frozen) per step: steps 0-1 are built as they end, the later ones wait in the queue
PLAN = [(False, False), (False, False), (False, False), (True, False), (True, False), (False, False),
        (False, True), (False, False)]


def _reference(model: nn.Module, x: torch.Tensor) -> list[dict[str, float]]:
    """Per step of PLAN: ‖∂loss/∂(block output)‖ of the blocks called with grad (retain_grad)."""
    twin = copy.deepcopy(model)
    kept: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, args, out):
            if out.requires_grad:
                out = out.view_as(out)
                out.retain_grad()
                kept[name] = out
                return out
            return None
        return hook

    for site, module in SITES.items():
        twin.get_submodule(module).register_forward_hook(keep(site))
    out = []
    for skip, frozen in PLAN:
        kept.clear()
        twin(x, skip, frozen).square().mean().backward()
        out.append({s: t.grad.double().norm().item() for s, t in kept.items()})  # (fp64: exact, on any CPU)
        twin.zero_grad()
    return out


def test_waiting_steps_are_checked_and_built_like_the_first():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 4, 8)
    want = _reference(model, x)
    rec = gradscope.Recorder(model, sites=SITES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (skip, frozen) in enumerate(PLAN):
            with rec.step(step):
                model(x, skip, frozen).square().mean().backward()
            model.zero_grad()
        df = rec.frame()  # (builds the waiting steps: their checks run now)
    said = [str(w.message) for w in caught]
    silent = [s for s in said if "saw no call" in s]
    assert len(silent) == 1 and "blocks.2.out" in silent[0] and "step 3" in silent[0], said
    no_grad = [s for s in said if "saw no gradient" in s]
    assert len(no_grad) == 1 and "blocks.0.out" in no_grad[0], said

    rows = df[(df.quantity == "act_grad_norm") & (df.micro_step == -1)]
    for step, expected in enumerate(want):
        got = dict(zip(rows[rows.step == step].site, rows[rows.step == step].value))
        assert set(got) == set(expected), (step, got, expected)
        for site, value in expected.items():
            assert abs(got[site] - value) <= 1e-6 * value, (step, site, got[site], value)  # (fp64 sums, stored as fp32: ≤ 6e-8)
    rec.close()


class TanhNorm(nn.Module):
    """An adaptive norm, ``w·tanh(a·x) + b``: not of the form g·x̂ + b, so the gradient through
    it alone is not known."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.a, self.weight, self.bias = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return self.weight * torch.tanh(self.a * x) + self.bias


class TwiceNormed(nn.Module):
    """The norm called twice: once on a finite input, once on one that holds an inf."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(d, d), TanhNorm(d), nn.Linear(d, 1)

    def forward(self, x):
        h = self.fc(x)
        bad = h.detach().clone()
        bad[0, 0] = float("inf")
        clean = torch.nan_to_num(self.norm(bad), nan=0.0, posinf=0.0, neginf=0.0)
        return self.head(self.norm(h)).square().mean() + 0 * clean.sum()


def test_a_norm_that_does_not_fit_stays_unfit_when_another_call_saw_an_inf():
    """One call's misfit is NaN (its input held an inf), the other's shows the norm is not
    g·x̂ + b: the norm is still named, and has no w/σ rows, in every step (its gradient rows,
    from the norm run again alone, are there)."""
    torch.manual_seed(0)
    model = TwiceNormed()
    rec = gradscope.Recorder(model, quantities=["act_grad_norm", "ln_gain", "ln_w_over_sigma"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):  # (steps 2 and 3 wait in the queue)
            with rec.step(step):
                model(torch.randn(16, 8) * 3).backward()
            model.zero_grad()
        df = rec.frame()
    said = [str(w.message) for w in caught]
    assert any("['norm'] do not map their normalised input" in s for s in said), said
    assert set(df.step) == {0, 1, 2, 3}
    assert df[(df.quantity == "ln_w_over_sigma") & df.site.str.startswith("norm")].empty
    assert set(df[df.quantity == "ln_gain"].step) == {0, 1, 2, 3}
    rec.close()
