"""The end of a recorded step: :meth:`StepEnd.finish` lets each quantity add its device values
to the step's buffer and takes them to the host in the step's one transfer
(:class:`HostStep`); :meth:`StepEnd.rows` turns those host values into rows later
(:class:`~gradscope.recorder.rows.late_rows.LateRows` calls it, in bulk).
"""

from __future__ import annotations

import contextlib
from array import array
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gradscope.recorder.capture.buffer_layout import Arrivals
from gradscope.recorder.capture.capture import Capture
from gradscope.recorder.capture.params import ParamGroups
from gradscope.recorder.capture.scaler_watch import ScalerWatch
from gradscope.recorder.capture.step_buffer import StepBuffer, Transferred
from gradscope.recorder.discovery.layout import Layout
from gradscope.recorder.quantities.built_in import LrSource
from gradscope.recorder.quantities.context import StepContext
from gradscope.recorder.quantities.quantity import Quantity
from gradscope.recorder.step.checks import StepChecks
from gradscope.recorder.step.host_rows import SCALE, host_marks, step_rows
from gradscope.table.keys import model_key


@dataclass
class HostStep:
    """A recorded step's values on the host, waiting to become rows (no device tensor)."""

    values: Transferred  # every value of the step, in one transfer
    marks: list[array]  # per snapshot: the order marks eager calls set on the host
    arrivals: list[Arrivals]  # per snapshot: which taps' gradients arrived
    wants: set[str]  # the quantities the step took
    calls: list[int]  # each counter's calls in the last forward
    params_unscaled: bool | None  # whether the loop unscaled the gradients (None: not known)
    backwards: int  # backwards the capture saw in the step
    grad_forwards: int  # forwards that ran with grad enabled
    forwards: int  # forwards, with grad or without
    grads_moved: bool | None = None  # unhooked capture: whether a parameter's gradient changed in the step


class StepEnd:
    """Ends one Recorder's recorded steps and builds their rows.

    Args:
        model, layout, groups: the recorded model, its layout and parameter groups.
        capture: the Recorder's capture (the step's snapshots, call counts, site plan).
        scaler_watch: the GradScaler's scale of the step's backward.
        checks: what the user is told about a recorded step.
        quantities: the Recorder's quantities, in the order their rows come.
        value_stats, grad_stats: the names of the quantities whose ``site_value`` /
            ``site_grad`` the capture takes, in its channel order.
        lr: where ``lr`` comes from.
    """

    def __init__(self, *, model: nn.Module, layout: Layout, groups: ParamGroups, capture: Capture,
                 scaler_watch: ScalerWatch, checks: StepChecks, quantities: dict[str, Quantity],
                 value_stats: tuple[str, ...], grad_stats: tuple[str, ...], lr: LrSource) -> None:
        self.model, self.layout, self.groups, self.capture = model, layout, groups, capture
        self.scaler_watch, self.checks, self.quantities, self.lr = scaler_watch, checks, quantities, lr
        self.value_stats, self.grad_stats = value_stats, grad_stats
        self._key_cache: dict = {}  # row keys kept from step to step (StepData.step_keys)

    def finish(self, step: int, wants: set[str], buffer: StepBuffer, *, optimizer: torch.optim.Optimizer | None,
               lr_used: float | torch.Tensor | None) -> HostStep:
        """Ends the capture, lets each wanted quantity collect, and takes the step's values
        to the host in one transfer."""
        capture = self.capture
        with no_autocast(capture.device):  # leaving the step inside autocast must not lower precision
            snapshots, calls = capture.end()
            if capture.sharded:
                self.checks.sharded(capture.sharded)
            scale = self.scaler_watch.step_scale()  # (the backward's: scaler.update() may have run since)
            if scale is not None:
                buffer.add(model_key(SCALE), scale)
            ctx = StepContext(step, self.model, self.layout, self.groups, optimizer, self.lr.from_optimizer,
                              capture.device, capture, buffer, self.checks.warned, lr_used=lr_used)
            for name, quantity in self.quantities.items():
                if name in wants:
                    ctx.current = quantity
                    if quantity.collect(ctx) is not None:
                        raise TypeError(f"{type(quantity).__name__}.collect returned a value, which records nothing: "
                                        "add values with ctx.add(key, value), ctx.add_many or ctx.add_model_value")
            self.lr.step_ended(wants, optimizer, self.checks.warn_once)
            buffer.add_block("snapshots", [t for s in snapshots for t in (s.grads, s.fwd)], (len(snapshots), -1))
            values = buffer.transfer()  # the one host transfer of this step
        return HostStep(values, [s.marks for s in snapshots], [s.arrivals for s in snapshots], wants, calls,
                        self.scaler_watch.params_unscaled(self.checks.warn_once), capture.backwards,
                        capture.grad_forwards, capture.forwards, capture.grads_moved)

    def rows(self, step: int, host: HostStep) -> tuple[list, np.ndarray]:
        """The rows of one recorded step from its host values (:class:`LateRows` calls it)."""
        keys, values, blocks = host.values.arrays()
        blocks["marks"], blocks["reached"] = host_marks(host.marks, host.arrivals, self.capture.n_taps)
        capture = self.capture
        keys, values, data = step_rows(keys, values, blocks, layout=self.layout, sites=capture.sites, K=capture.K,
                                       quantities=self.quantities, wants=host.wants,
                                       params_unscaled=host.params_unscaled, backwards=host.backwards,
                                       grad_forwards=host.grad_forwards, forwards=host.forwards, grads_moved=host.grads_moved,
                                       call_counts=host.calls,
                                       value_stats=self.value_stats, grad_stats=self.grad_stats, width=capture.width,
                                       key_cache=self._key_cache, closed_form=capture.closed_form)
        self.checks.after(step, data, host.calls, host.wants)
        self.checks.merged(step, [n for n in self.quantities
                                  if n in host.wants and self.quantities[n].merged_away(data)])
        return keys, values


@contextlib.contextmanager
def no_autocast(device: torch.device | None):
    """Autocast off for ``device`` inside (entered only where it is on: building a
    ``torch.autocast`` costs more than the check)."""
    if device is None or not torch.is_autocast_enabled(device.type):
        yield
        return
    with torch.autocast(device_type=device.type, enabled=False):
        yield
