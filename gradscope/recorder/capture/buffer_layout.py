"""The layout of what a recorded step writes on the device, named once: the forward buffer's
channels, a snapshot of one micro-step, and the marks of which gradients arrived."""

from __future__ import annotations

from array import array
from typing import NamedTuple

import torch

# forward-buffer channels (columns of ``Capture.fwd``, one row per slot)
ORDER = 0  # ±order of the slot's call in the forward (negative: not tapped for its gradient; 0: not called)
VALUE = 1  # a site's ‖h‖², added over the forwards of a micro-step; a norm's w/σ
MISFIT = 2  # a fitted norm's misfit (numerics/norm_stats.py marks: GUESSED, UNTOLD, LOW_PRECISION)
FIRST_USER = 3  # a user quantity's site_value k is channel FIRST_USER + k

# whether a tap's gradient arrived in a snapshot
REACHED = 1  # it did (seen eagerly)
REACHED_IF_TAPPED = 2  # a compiled backward ran: it did where the slot was tapped (a compiled graph cannot tell)


class Arrivals(NamedTuple):
    """Which taps' gradients arrived in one snapshot: a code for every tap (0,
    :data:`REACHED_IF_TAPPED`), then the slots that were seen to arrive (:data:`REACHED`)."""

    every: int
    slots: list[int]


class Snapshot(NamedTuple):
    """One micro-step's captures, set aside at the end of its backward (or of the step)."""

    grads: torch.Tensor  # the collector's gradient: ‖grad‖² per tap, then the user statistics
    fwd: torch.Tensor  # the forward buffer (n_slots, channels)
    marks: array  # order marks eager calls set on the host (doubles, one per slot)
    arrivals: Arrivals
