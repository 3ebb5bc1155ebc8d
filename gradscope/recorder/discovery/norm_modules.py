"""What counts as a normalisation module, in a zoo model or any other (the rule is in
:mod:`gradscope.recorder.discovery.layout`'s docstring, "Norms")."""

from __future__ import annotations

from torch import nn

from gradscope.models.norms import ScaleNorm
from gradscope.models.sites import SiteNorm

KNOWN_NORMS = (
    nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm, ScaleNorm,
    nn.modules.batchnorm._NormBase,
)

def is_norm(module: nn.Module, name: str = "") -> bool:
    """Whether ``module`` normalises activations (see the module docstring for the rule)."""
    if isinstance(module, SiteNorm):
        return False  # its ``inner`` is the norm
    if isinstance(module, KNOWN_NORMS):
        return True
    if "parametrizations" in name.split(".") or not type(module).__name__.endswith("Norm"):
        return False
    children = list(module.children())
    if children and not wraps_a_bare_norm(module):
        return False  # holds sub-modules: a layer, not a norm
    return all(p.dim() <= 1 for p in module.parameters(recurse=False))


def wraps_a_bare_norm(module: nn.Module) -> bool:
    """A ``*Norm`` class whose one child is a norm with no parameters, the gain its own
    (x-transformers' ``LayerNorm``: ``self.ln(x) * self.gamma``): the class is the norm."""
    children = list(module.children())
    return (len(children) == 1 and isinstance(children[0], KNOWN_NORMS) and not any(True for _ in children[0].parameters())
            and type(module).__name__.endswith("Norm"))
