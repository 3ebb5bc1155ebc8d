"""The init registry: how weights start, independent of the wiring.

Every init sets biases to 0 and norms to their identity (LayerNorm w=1, b=0; ScaleNorm
g=sqrt(d)). Variant-owned parameters (DLCL W, Admin ω, ReZero α, transparent-attention W)
keep the values their modules start with.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from gradscope.models.norms import ScaleNorm
from gradscope.models.rescale import ATTENTION_ROLES, layer_linears

QKV_ROLES = frozenset({"q_proj", "k_proj", "v_proj"})


@torch.no_grad()
def reset_norms(model: nn.Module) -> None:
    """LayerNorm/RMSNorm weight 1, bias 0; ScaleNorm g = sqrt(d)."""
    for module in model.modules():
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            if module.weight is not None:
                module.weight.fill_(1.0)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, ScaleNorm):
            module.reset_parameters()


def _each_layer_linear(model: nn.Module):
    """Yields (1-based layer index, role, linear) over every stack of a zoo model."""
    for stack in model.stacks().values():
        for l, layer in enumerate(stack.layers, start=1):
            for role, linear in layer_linears(layer):
                yield l, role, linear


@torch.no_grad()
def _normal_embeddings(model: nn.Module, config) -> None:
    for stack in model.stacks().values():
        nn.init.normal_(stack.embed.tokens.weight, std=config.d_model**-0.5)


@torch.no_grad()
def xavier(model: nn.Module, config) -> None:
    """fairseq-like: Xavier-uniform linears, q/k/v with gain 1/√2, embeddings N(0, d^-½)."""
    for _, role, linear in _each_layer_linear(model):
        nn.init.xavier_uniform_(linear.weight, gain=1 / math.sqrt(2) if role in QKV_ROLES else 1.0)
        nn.init.zeros_(linear.bias)
    _normal_embeddings(model, config)
    reset_norms(model)


def lipschitz_bound(fan_in: int) -> float:
    """l = sqrt(1/fan_in) (Xu 2020 §3.2)."""
    return math.sqrt(1.0 / fan_in)


@torch.no_grad()
def lipschitz(model: nn.Module, config) -> None:
    """Xu 2020 §3.2: matrices U(−l, l), l = sqrt(1/fan_in); embeddings U(−e, e), e = sqrt(2/(d+vocab))."""
    for _, _, linear in _each_layer_linear(model):
        bound = lipschitz_bound(linear.in_features)
        nn.init.uniform_(linear.weight, -bound, bound)
        nn.init.zeros_(linear.bias)
    e = math.sqrt(2.0 / (config.d_model + config.vocab))
    for stack in model.stacks().values():
        nn.init.uniform_(stack.embed.tokens.weight, -e, e)
    reset_norms(model)


@torch.no_grad()
def small(model: nn.Module, config) -> None:
    """Nguyen & Salazar 2019 §4.1: attention N(0, sqrt(2/(5d))), FFN N(0, sqrt(2/(d+d_ff)))."""
    d, d_ff = config.d_model, config.d_ff
    for _, role, linear in _each_layer_linear(model):
        std = math.sqrt(2 / (5 * d)) if role in ATTENTION_ROLES else math.sqrt(2 / (d + d_ff))
        nn.init.normal_(linear.weight, std=std)
        nn.init.zeros_(linear.bias)
    _normal_embeddings(model, config)
    reset_norms(model)


def ds_init_bound(layer: int, fan_in: int, fan_out: int, alpha: float, form: str) -> float:
    """DS-Init bound of layer l (1-based), γ = sqrt(6/(fan_in+fan_out)) (Zhang 2019 Eq. 11).

    ``paper``: γα/√l (variance × 1/l). ``code``: γα/l^¼ (variance × 1/√l, the released code).
    """
    gamma = math.sqrt(6.0 / (fan_in + fan_out))
    return gamma * alpha / (math.sqrt(layer) if form == "paper" else layer**0.25)


@torch.no_grad()
def ds_init(model: nn.Module, config) -> None:
    """Depth-scaled init (Zhang 2019): layer l's matrices U(−b_l, b_l); embeddings N(0, d^-½)."""
    form = config.ds_init_form or "paper"
    alpha = 1.0 if config.ds_init_alpha is None else config.ds_init_alpha
    for l, _, linear in _each_layer_linear(model):
        bound = ds_init_bound(l, linear.in_features, linear.out_features, alpha, form)
        nn.init.uniform_(linear.weight, -bound, bound)
        nn.init.zeros_(linear.bias)
    _normal_embeddings(model, config)
    reset_norms(model)


INITS: dict[str, Callable[[nn.Module, object], None]] = {
    "xavier": xavier,
    "lipschitz": lipschitz,
    "small": small,
    "ds_init": ds_init,
}
