"""A user's site statistic at a site called several times in one micro-step: two forwards
before one backward, or a shared block called more often than ``max_calls``. The Recorder
cannot combine the calls' values by the quantity's rule there (a value statistic kept the
last call's, a gradient statistic the sum), so those sites have no rows of it, with a
warning; a gradient statistic summed over calls keeps them. References: a twin of the model
that no Recorder saw, with this test's own hooks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradscope
from test_user_quantities import GradRms, MaxAbs  # (the quantities of the contract's own test)
from gradscope.recorder.options import RecorderOptions


class GradAbsSum(gradscope.Quantity):
    name = "act_grad_abs_sum"
    over_micro_steps = "sum"
    needs_backward = True

    def site_grad(self, grad):
        return grad.double().abs().sum().float()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(x + torch.tanh(self.lin(x)))


class Net(nn.Module):
    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        block = Block()
        self.blocks = nn.ModuleList([block, block, block] if shared else [Block(), Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def outputs_of(model: nn.Module, name: str, run) -> list[torch.Tensor]:
    """The outputs of ``model``'s module ``name`` in each of its calls during ``run()``, with
    their gradients kept."""
    seen = []

    def keep(module, args, out):
        out.retain_grad()
        seen.append(out)
    handle = model.get_submodule(name).register_forward_hook(keep)
    run(model)
    handle.remove()
    return seen


def rows(frame, quantity: str, site: str):
    return frame[(frame.quantity == quantity) & (frame.site == site)]


def test_two_forwards_before_one_backward_leave_no_rows_of_a_statistic_that_cannot_add_up():
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    x1, x2 = torch.randn(3, 4, 8), torch.randn(3, 4, 8)

    def step(m):
        (m(x1).square().mean() + 3 * m(x2).square().mean()).backward()
    rec = gradscope.Recorder(model, quantities=["act_norm", MaxAbs(), GradRms(), GradAbsSum()])
    with pytest.warns(UserWarning, match="act_max_abs.*act_grad_rms.*called several times in one micro-step"):
        with rec.step(0):
            step(model)
        frame = rec.frame()
    rec.close()
    site = "blocks.1.out"
    assert rows(frame, "act_max_abs", site).empty and rows(frame, "act_grad_rms", site).empty
    outs = outputs_of(twin, "blocks.1", step)
    assert len(outs) == 2
    summed = sum(o.grad.double().abs().sum() for o in outs).item()
    got = rows(frame, "act_grad_abs_sum", site).value
    assert len(got) == 1 and got.iloc[0] == pytest.approx(summed, rel=1e-6)
    norm = sum(o.detach().double().square().sum() for o in outs).sqrt().item()  # the built-in adds up
    assert rows(frame, "act_norm", site).value.iloc[0] == pytest.approx(norm, rel=1e-6)


def test_one_forward_per_micro_step_keeps_every_row():
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    xs = [torch.randn(3, 4, 8), torch.randn(3, 4, 8)]

    def step(m):
        for x in xs:
            m(x).square().mean().backward()
    rec = gradscope.Recorder(model, quantities=[MaxAbs(), GradRms()])
    with rec.step(0):
        step(model)
    frame = rec.frame(micro_steps=True)
    rec.close()
    outs = outputs_of(twin, "blocks.1", step)
    got = rows(frame, "act_max_abs", "blocks.1.out").set_index("micro_step").value
    assert got[0] == outs[0].abs().amax().item() and got[1] == outs[1].abs().amax().item()
    assert got[-1] == max(got[0], got[1])
    assert len(rows(frame, "act_grad_rms", "blocks.1.out")) == 3


def test_calls_past_max_calls_leave_no_row_of_the_shared_last_slot():
    torch.manual_seed(0)
    model = Net(shared=True)
    twin = copy.deepcopy(model)
    x = torch.randn(3, 4, 8)

    def step(m):
        m(x).square().mean().backward()
    rec = gradscope.Recorder(model, quantities=["act_norm", MaxAbs(), GradAbsSum()],
                             options=RecorderOptions(max_calls=2))
    with pytest.warns(UserWarning, match="act_max_abs.*max_calls=2"):
        with rec.step(0):
            step(model)
        frame = rec.frame()
    rec.close()
    outs = outputs_of(twin, "blocks.0", step)
    assert len(outs) == 3
    first = rows(frame, "act_max_abs", "blocks.0.out").value
    assert len(first) == 1 and first.iloc[0] == outs[0].abs().amax().item()
    assert rows(frame, "act_max_abs", "blocks.0.out#2").empty  # (calls 2 and 3 share it)
    shared = rows(frame, "act_grad_abs_sum", "blocks.0.out#2").value
    assert shared.iloc[0] == pytest.approx(sum(o.grad.double().abs().sum() for o in outs[1:]).item(), rel=1e-6)
    assert not rows(frame, "act_norm", "blocks.0.out#2").empty


def test_a_collect_that_returns_its_value_is_refused():
    class Returns(gradscope.Quantity):
        name = "returns_value"

        def collect(self, ctx):
            return torch.ones(())
    model = Net()
    rec = gradscope.Recorder(model, quantities=[Returns()])
    with pytest.raises(TypeError, match="Returns.collect returned a value, which records nothing"):
        with rec.step(0):
            model(torch.randn(2, 8)).sum().backward()
    rec.close()
