"""Residual sub-layers: where the norm sits and how the skip and branch are scaled.

One interface for every wiring (x-transformers style): a sub-layer wraps a function F and
computes, with ``skip``, ``gate`` and ``layer_skip`` small modules chosen by the variant,

    s = layer_skip(skip(x) + gate(dropout(F(norm(x) or x))), x_layer)

then ``PostNormSublayer`` returns ``norm(s)`` and ``PreNormSublayer`` returns ``s``.
``x_layer`` is the input of the whole layer (used by B2T's bottom-to-top connection).

Sites (docs/zoo.md, "Sites"), relative to the sub-layer: ``branch`` (dropout(F(...)) before any gate),
``sum`` (s), ``norm.in`` / ``norm.out`` when the wiring has a norm.
"""

from __future__ import annotations

import torch
from torch import nn

from gradscope.models.sublayers import Context
from gradscope.models.sites import Site, SiteNorm


class ConstScale(nn.Module):
    """Multiplies by a fixed scalar (DeepNorm's α, Wang 2022 Eq. 7)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.value * x

    def extra_repr(self) -> str:
        return f"value={self.value:.6g}"


class VectorScale(nn.Module):
    """Learnable per-feature scale ω ⊙ x (Admin's ω_i, Liu 2020 Eq. 6); starts at 1."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.omega = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.omega * x


class ScalarGate(nn.Module):
    """Learnable scalar α · F(x), α starting at 0 (ReZero, Bachlechner 2020 Eq. 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha * x


class NoLayerSkip(nn.Module):
    """The plain sub-layer: ignores the layer input."""

    def forward(self, s: torch.Tensor, x_layer: torch.Tensor) -> torch.Tensor:
        return s


class BottomToTop(nn.Module):
    """B2T connection: β·s + α·x_layer (Takase 2022 Eq. 5 with α=β=1; App. D Eq. 6)."""

    def __init__(self, alpha: float = 1.0, beta: float = 1.0) -> None:
        super().__init__()
        self.alpha = alpha
        self.beta = beta

    def forward(self, s: torch.Tensor, x_layer: torch.Tensor) -> torch.Tensor:
        return self.beta * s + self.alpha * x_layer  # scaling by 1.0 is exact in IEEE

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:.6g}, beta={self.beta:.6g}"


class Sublayer(nn.Module):
    """Shared parts of every residual sub-layer.

    Args:
        fn: the branch function F(h, ctx).
        norm: the normalisation module (wrapped in a :class:`SiteNorm`), or None.
        skip: module applied to the skip path x (default identity).
        gate: module applied to the branch output (default identity).
        layer_skip: combines the sum with the layer input (default: ignores it).
        dropout: residual dropout probability on F's output.
    """

    def __init__(
        self,
        fn: nn.Module,
        *,
        norm: nn.Module | None = None,
        skip: nn.Module | None = None,
        gate: nn.Module | None = None,
        layer_skip: nn.Module | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.norm = SiteNorm(norm) if norm is not None else nn.Identity()
        self.fn = fn
        self.drop = nn.Dropout(dropout)
        self.branch = Site()
        self.skip = skip if skip is not None else nn.Identity()
        self.gate = gate if gate is not None else nn.Identity()
        self.layer_skip = layer_skip if layer_skip is not None else NoLayerSkip()
        self.sum = Site()

    def residual(self, x: torch.Tensor, h: torch.Tensor, ctx: Context, x_layer: torch.Tensor) -> torch.Tensor:
        """Returns the residual sum s for skip input ``x`` and branch input ``h``."""
        f = self.branch(self.drop(self.fn(h, ctx)))
        return self.sum(self.layer_skip(self.skip(x) + self.gate(f), x_layer))


class PostNormSublayer(Sublayer):
    """y = norm(s), s = skip(x) + F(x): Post-LN (Vaswani 2017), and no-norm when norm=None."""

    def forward(self, x: torch.Tensor, ctx: Context, x_layer: torch.Tensor) -> torch.Tensor:
        return self.norm(self.residual(x, x, ctx, x_layer))


class PreNormSublayer(Sublayer):
    """y = skip(x) + F(norm(x)): Pre-LN (Wang 2019 Eq. 4)."""

    def forward(self, x: torch.Tensor, ctx: Context, x_layer: torch.Tensor) -> torch.Tensor:
        return self.residual(x, self.norm(x), ctx, x_layer)
