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


DEEPNORM_BETA_ROLES = frozenset({"fc1", "fc2", "v_proj", "out_proj"})


def deepnorm_rescale(model: nn.Module, betas: dict[str, float]) -> None:
    """Multiplies FFN, value and output projections by β, not q/k (kept for the API; the
    ``deepnorm`` variant uses :func:`deepnorm_paper_init` or :func:`deepnorm_torchscale_init`).

    Args:
        model: a zoo model.
        betas: stack name → β.
    """
    for name, stack in model.stacks().items():
        beta = betas[name]
        for layer in stack.layers:
            scale_roles(layer, dict.fromkeys(DEEPNORM_BETA_ROLES, beta))


@torch.no_grad()
def deepnorm_paper_init(model: nn.Module, betas: dict[str, float]) -> None:
    """Wang 2022 (DeepNet) Fig. 2's pseudocode, per stack: ``xavier_normal_(w, gain=β)`` for
    fc1, fc2, v_proj and out_proj, ``xavier_normal_(w, gain=1)`` for q_proj and k_proj
    (self- and cross-attention); biases and embeddings keep the base init.

    Args:
        model: a zoo model.
        betas: stack name → β.
    """
    for name, stack in model.stacks().items():
        for layer in stack.layers:
            for role, linear in layer_linears(layer):
                if role in DEEPNORM_BETA_ROLES:
                    nn.init.xavier_normal_(linear.weight, gain=betas[name])
                elif role in ("q_proj", "k_proj"):
                    nn.init.xavier_normal_(linear.weight, gain=1.0)


def torchscale_init_scale(config, stack: str) -> float:
    """torchscale's DeepNorm ``init_scale`` (the divisor of its init) for one stack:
    encoder (N⁴M)^(1/16) / 1.15 in an encoder-decoder, else (8N)^¼; decoder (12M)^¼ in an
    encoder-decoder, else (8M)^¼ (torchscale/architecture/encoder.py, decoder.py)."""
    N, M = config.n_enc, config.n_dec
    if stack == "encoder":
        return (N**4 * M) ** (1 / 16) / 1.15 if config.arch == "encoder_decoder" else (8 * N) ** 0.25
    return (12 * M) ** 0.25 if config.arch == "encoder_decoder" else (8 * M) ** 0.25


@torch.no_grad()
def deepnorm_torchscale_init(model: nn.Module, scales: dict[str, float]) -> None:
    """torchscale's DeepNorm init, per stack: q/k/v ``xavier_uniform_`` with gain 1/√2,
    out_proj gain 1 and bias 0, fc1/fc2 torch's default ``nn.Linear`` init; then the weights
    and biases of fc1, fc2, out_proj and v_proj divided by the stack's ``init_scale``.

    Args:
        model: a zoo model.
        scales: stack name → init_scale (:func:`torchscale_init_scale`).
    """
    for name, stack in model.stacks().items():
        for layer in stack.layers:
            for role, linear in layer_linears(layer):
                if role in ATTENTION_ROLES:
                    nn.init.xavier_uniform_(linear.weight, gain=1.0 if role == "out_proj" else 1 / math.sqrt(2))
                    if role == "out_proj" and linear.bias is not None:
                        nn.init.zeros_(linear.bias)
                elif role in FFN_ROLES:
                    linear.reset_parameters()
                if role in DEEPNORM_BETA_ROLES:
                    for p in linear.parameters():
                        p.div_(scales[name])


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
