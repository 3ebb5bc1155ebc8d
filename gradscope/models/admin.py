"""Admin's profiling initialisation (Liu 2020, "Understanding the Difficulty of Training
Transformers", Algorithm 1, as in Transformer-Clinic).

For each stack, with a running r = 1, visit the Admin sub-layers in forward order:
set ω_i = r, then r ← sqrt(Var(ω_i·x_{i-1}) + Var(F_i(x_{i-1}))). Variances are population
variances over every element of the batch tensor (padding included), measured in training
mode (dropout active, as Transformer-Clinic's profiling forward runs) under ``torch.no_grad``;
seed torch first for a repeatable profile.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gradscope.models.residual import Sublayer, VectorScale


def admin_sublayers(model: nn.Module) -> list[tuple[str, Sublayer]]:
    """(name, sub-layer) of every sub-layer whose skip is Admin's ω, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Sublayer) and isinstance(m.skip, VectorScale)]


@torch.no_grad()
def admin_init(model: nn.Module, *inputs: torch.Tensor) -> dict[str, float]:
    """Sets every ω of an ``admin`` model from one profiling forward pass on ``inputs``.

    Args:
        model: a zoo model built with ``variant="admin"``.
        *inputs: one batch, as the model takes it (``src, tgt_in`` or ``tokens``).

    Returns:
        Sub-layer name → the ω value it was given.

    Raises:
        ValueError: the model has no Admin sub-layers.
    """
    sublayers = admin_sublayers(model)
    if not sublayers:
        raise ValueError("admin_init: model has no Admin sub-layers; build it with variant='admin'")
    running: dict[str, float] = {}
    measured: dict[str, float] = {}
    omegas: dict[str, float] = {}
    handles = []

    def before(name: str, stack: str):
        def hook(module: Sublayer, args):
            r = running.setdefault(stack, 1.0)
            module.skip.omega.fill_(r)
            omegas[name] = r
            measured[name] = torch.var(module.skip(args[0]), unbiased=False).item()

        return hook

    def branch_out(name: str):
        def hook(module, args, output):
            measured[name] += torch.var(output, unbiased=False).item()

        return hook

    def after(name: str, stack: str):
        def hook(module, args, output):
            running[stack] = math.sqrt(measured[name])

        return hook

    was_training = model.training
    model.train()
    try:
        for name, sub in sublayers:
            stack = name.split(".", 1)[0]
            handles.append(sub.register_forward_pre_hook(before(name, stack)))
            handles.append(sub.branch.register_forward_hook(branch_out(name)))
            handles.append(sub.register_forward_hook(after(name, stack)))
        model(*inputs)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return omegas
