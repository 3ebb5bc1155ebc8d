"""Normalisation layers: LayerNorm (PyTorch's), ScaleNorm, RMSNorm (PyTorch's)."""

from __future__ import annotations

import math

import torch
from torch import nn


class ScaleNorm(nn.Module):
    """ScaleNorm: g · x / max(‖x‖₂, eps) over the last dim (Nguyen & Salazar 2019, Eq. 7).

    Args:
        d_model: width d; the scalar gain g starts at sqrt(d).
        eps: lower bound on the norm (1e-5 as in the paper's code).
    """

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.d_model = d_model
        self.eps = eps
        self.g = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Sets g = sqrt(d)."""
        with torch.no_grad():
            self.g.fill_(math.sqrt(self.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(self.eps)
        return self.g * x / norm


def layer_norm(d_model: int, eps: float) -> nn.Module:
    """PyTorch's LayerNorm with affine weight 1 and bias 0."""
    return nn.LayerNorm(d_model, eps=eps)


def scale_norm(d_model: int, eps: float) -> nn.Module:
    """ScaleNorm with the fixed 1e-5 floor of Nguyen & Salazar (``eps`` is LayerNorm's)."""
    del eps
    return ScaleNorm(d_model)
