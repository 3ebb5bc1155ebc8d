"""Compiled, a module called several times in one forward records every call's gradient
exactly: the first call's taps write through the collector's strided view of first calls,
later calls into the collector itself (``Capture.traced_slot``), and a user statistic of the
gradient lands beside each. Checked against tensor hooks on a plain copy of the model."""

from __future__ import annotations

import copy

import torch
from torch import nn

import gradscope
from twin_models import TanhBlock

BOUND = 1e-5  # relative: fp32 norms of the same gradient, compiled against eager autograd (observed ≈1e-7)


class GradAbsMax(gradscope.Quantity):
    name = "grad_abs_max"
    description = "largest |∂loss/∂h| at a site"
    needs_backward = True

    def site_grad(self, grad):
        return grad.abs().amax()


class Shared(nn.Module):
    """An input layer, one block applied three times (ALBERT-style), a head."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList([TanhBlock(d)])
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(3):
            h = self.layers[0](h)
        return self.head(h).pow(2).mean()


def _autograd_reference(model: Shared, x: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Per call (in call order), the gradient at the norm's output, and at its input through
    the norm alone (SPEC §3: Jᵀ of the norm applied to the output's gradient), from tensor
    hooks on a plain copy."""
    ln = model.layers[0].ln
    inputs: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []

    def keep(module, args, out):
        inputs.append(args[0].detach().clone())
        out.register_hook(lambda g: outs.append(g.detach().clone()))

    handle = ln.register_forward_hook(keep)
    model(x).backward()
    handle.remove()
    outs = outs[::-1]  # the hooks fired last call first
    through = []
    for h, g in zip(inputs, outs):
        h = h.requires_grad_()
        through.append(torch.autograd.grad(ln(h), h, g)[0])
    return {"layers.0.ln.out": outs, "layers.0.ln.in": through}


def test_compiled_calls_of_a_shared_module_record_their_own_gradients():
    torch.manual_seed(0)
    model, x = Shared(), torch.randn(4, 5, 8)
    want = _autograd_reference(copy.deepcopy(model), x)
    rec = gradscope.Recorder(model, quantities=["act_grad_norm", GradAbsMax()])
    run = torch.compile(model, fullgraph=True)
    with rec.step(0):
        run(x).backward()
    df = rec.frame()
    rec.close()
    got = df[df.micro_step == -1].set_index(["quantity", "site"]).value
    for name, grads in want.items():
        assert len(grads) == 3
        for call, g in enumerate(grads):
            site = name if call == 0 else f"{name}#{call + 1}"
            norm, top = g.norm().item(), g.abs().max().item()
            assert abs(got["act_grad_norm", site] / norm - 1) < BOUND, (site, got["act_grad_norm", site], norm)
            assert abs(got["grad_abs_max", site] / top - 1) < BOUND, (site, got["grad_abs_max", site], top)
