"""Weight rescalings applied after the base init: DeepNorm β, T-Fixup, B2T's N^-½.

All act in place under ``torch.no_grad`` on the zoo's named linears: inside a layer, the
roles are ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (self- and cross-attention) and
``fc1``, ``fc2`` (FFN).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

ATTENTION_ROLES = frozenset({"q_proj", "k_proj", "v_proj", "out_proj"})
FFN_ROLES = frozenset({"fc1", "fc2"})


def layer_linears(layer: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """Yields (role, linear) for every ``nn.Linear`` inside one layer, role = last name part."""
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear):
            yield name.rsplit(".", 1)[-1], module


@torch.no_grad()
def scale_roles(layer: nn.Module, factors: dict[str, float]) -> None:
    """Multiplies the weight of each linear whose role is in ``factors`` by that factor."""
    for role, linear in layer_linears(layer):
        if role in factors:
            linear.weight.mul_(factors[role])


def deepnorm_rescale(model: nn.Module, betas: dict[str, float]) -> None:
    """Scales FFN, value and output projections by β, not q/k (Wang 2022 DeepNet Fig. 2).

    Args:
        model: a zoo model.
        betas: stack name → β.
    """
    for name, stack in model.stacks().items():
        beta = betas[name]
        for layer in stack.layers:
            scale_roles(layer, {"v_proj": beta, "out_proj": beta, "fc1": beta, "fc2": beta})


def tfixup_factors(config, stack: str) -> tuple[float, float]:
    """(in-layer factor, embedding factor) of T-Fixup for one stack (Huang 2020 §3.2).

    Encoder: fc1, fc2, out_proj × 0.67·N^-¼ (v_proj × that·√2), embedding × (9N)^-¼.
    Decoder: the same with (9M)^-¼ for the in-layer factor and the embedding.
    """
    if stack == "encoder":
        return 0.67 * config.n_enc**-0.25, (9 * config.n_enc) ** -0.25
    return (9 * config.n_dec) ** -0.25, (9 * config.n_dec) ** -0.25


@torch.no_grad()
def tfixup_rescale(model: nn.Module, config) -> None:
    """Applies T-Fixup's scaling to every stack of ``model`` (Huang 2020 Algorithm 1)."""
    for name, stack in model.stacks().items():
        s, e = tfixup_factors(config, name)
        for layer in stack.layers:
            scale_roles(layer, {"fc1": s, "fc2": s, "out_proj": s, "v_proj": s * math.sqrt(2)})
        stack.embed.tokens.weight.mul_(e)


def b2t_rescale(model: nn.Module) -> None:
    """Multiplies every in-layer matrix by N^-½, N that stack's depth (B2T's later code)."""
    for stack in model.stacks().values():
        factor = len(stack.layers) ** -0.5
        for layer in stack.layers:
            scale_roles(layer, {role: factor for role in ATTENTION_ROLES | FFN_ROLES})
