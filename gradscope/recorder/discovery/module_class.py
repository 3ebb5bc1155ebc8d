"""A module's own class while a recorder has swapped it (an armed twin or a carrying class
of :mod:`gradscope.recorder.capture.hookset`): what the layout compares blocks by."""

from __future__ import annotations

from torch import nn

STANDS_FOR: dict[type, type] = {}
"""An armed twin or a carrying class in use -> the class it stands for (written by the
hook sets of :mod:`gradscope.recorder.capture.hookset`)."""


def own_class(module: nn.Module) -> type:
    """A module's own class, also while it is armed (not its armed twin or carrying class)."""
    cls = type(module)
    return STANDS_FOR.get(cls, cls)
