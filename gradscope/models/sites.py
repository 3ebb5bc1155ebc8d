"""Named hook points ("sites") placed inside ``forward``, TransformerLens style.

A :class:`Site` is an identity module; its name in ``model.named_modules()`` is the site
name (docs/zoo.md, "Sites"; ``decoder.layers.3.cross_attn.norm.in``). The recorder hooks sites; a
model without a recorder pays one Python call per site and nothing else.
"""

from __future__ import annotations

import torch
from torch import nn


class Site(nn.Module):
    """Identity hook point: ``forward(x) -> x``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class SiteNorm(nn.Module):
    """A normalisation layer with ``in`` and ``out`` sites around it.

    Module names: ``<prefix>.in`` (norm input), ``<prefix>.inner`` (the norm itself, e.g.
    ``nn.LayerNorm``; its parameters are ``<prefix>.inner.weight``), ``<prefix>.out``.

    Args:
        inner: the normalisation module.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.add_module("in", Site())  # ``in`` is a keyword: registered by name
        self.inner = inner
        self.out = Site()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(self._modules["in"](x)))


def site_names(model: nn.Module) -> list[str]:
    """Lists the names of every :class:`Site` in ``model``, in module-tree order."""
    return [name for name, module in model.named_modules() if isinstance(module, Site)]
