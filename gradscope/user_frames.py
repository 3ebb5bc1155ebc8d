"""Where a warning should point: the user's line, not gradscope's or torch's."""

from __future__ import annotations

import contextlib
import os
import sys

import torch

_INTERNAL = (os.path.dirname(__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep,  # (gradscope/, torch/)
             contextlib.__file__)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the user's line: the first frame
    above the caller of ``warnings.warn`` outside gradscope, torch and contextlib (a
    warning from rows built later, at ``frame()``, points at that call; one from a hook
    during backward at ``loss.backward()``)."""
    frame, level = sys._getframe(2), 2  # (1 would be warnings.warn's caller)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level
