"""The model to record inside its wrappers (DDP, ``torch.compile``, a LightningModule holding a zoo model)."""

from __future__ import annotations

from torch import nn

from gradscope.recorder.discovery.layout import is_zoo


def unwrap(model: nn.Module) -> nn.Module:
    """The model to record inside wrappers: DDP's ``.module``, ``torch.compile``'s
    ``_orig_mod``, and a zoo model held by a LightningModule or similar, so that site names
    stay canonical."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            break
    if is_zoo(model):
        return model
    return next((m for m in model.modules() if is_zoo(m)), model)

