"""A layer is a sequence of residual sub-layers; a stack is embedding → layers → final norm."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gradscope.models.sublayers import Context
from gradscope.models.sites import Site, SiteNorm


class Layer(nn.Module):
    """One encoder or decoder layer: sub-layers run in order between ``in`` and ``out`` sites.

    Args:
        sublayers: name → sub-layer, in execution order (``self_attn``, ``cross_attn``,
            ``ffn``). Each is called as ``sub(h, ctx, x_layer)`` with ``x_layer`` the layer
            input, which only a bottom-to-top connection uses.
    """

    def __init__(self, sublayers: dict[str, nn.Module]) -> None:
        super().__init__()
        self.add_module("in", Site())
        for name, sub in sublayers.items():
            self.add_module(name, sub)
        self.out = Site()
        self.sublayer_names = tuple(sublayers)

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        x = self._modules["in"](x)  # (B, T, d)
        h = x
        for name in self.sublayer_names:
            h = self._modules[name](h, ctx, x)
        return self.out(h)


class Stack(nn.Module):
    """Embedding, layers joined by a connection, and an optional final norm.

    Args:
        embed: the embedding module (site ``embed.out`` is y_0).
        layers: the L layers.
        combine: the connection (plain :class:`~gradscope.models.connections.Sequential`,
            or DLCL) that runs the layers.
        final_norm: normalisation after the stack (Pre-LN), or None.
    """

    def __init__(self, embed: nn.Module, layers: Sequence[Layer], combine: nn.Module, final_norm: nn.Module | None) -> None:
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.combine = combine
        self.final_norm = SiteNorm(final_norm) if final_norm is not None else nn.Identity()

    def forward(self, tokens: torch.Tensor, ctxs: Sequence[Context]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns (stack output (B, T, d), [y_0, ..., y_L]) for ``ctxs``, one context per layer."""
        out, ys = self.combine.run(self.layers, self.embed(tokens), ctxs)
        return self.final_norm(out), ys
