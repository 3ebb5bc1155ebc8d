"""What a ``torch.amp.GradScaler`` did during a recorded step, read when it matters.

Gradient norms are stored unscaled: divided by the scale the step's backward ran with, and
the parameters' norms only if their gradients were not unscaled in place already. Both can
change inside the step: a loop that calls ``scaler.step(opt)`` and ``scaler.update()``
inside ``with rec.step(i):`` unscales the gradients in place and may change the scale
before the step ends, when the rows are taken. So the scale is read at the end of each
backward (a copy: ``update`` changes the scale tensor in place), and the unscaling is seen
in the scaler's per-optimizer stage at the end of the step or, when the Recorder has the
optimizer, just before its ``step`` (``scaler.step`` unscales, then steps, then marks the
optimizer STEPPED; an optimizer that unscales inside its own fused step never shows
UNSCALED and leaves the gradients scaled). An ``update`` inside the step replaces the
stages; without the optimizer's hook the Recorder then cannot tell whether the gradients
were unscaled, so the parameters' norms get no rows, and it says so once; an
attached optimizer whose step was not seen skipped it (inf or NaN gradients, after
``scaler.step`` unscaled them).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial

import torch

from gradscope.recorder.capture.optimizer_step import stepping_optimizer


def grad_scale(scaler) -> torch.Tensor | None:
    """A ``torch.amp.GradScaler``'s current scale as a 0-d fp32 tensor (no host sync), or None
    without an enabled scaler."""
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler._get_scale_async().detach().float().reshape(())


def params_unscaled(scaler) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` ran since the last ``update`` (True without an
    enabled scaler)."""
    if scaler is None or not scaler.is_enabled():
        return True
    from torch.amp.grad_scaler import OptState

    return any(s.get("stage") is OptState.UNSCALED for s in scaler._per_optimizer_states.values())


class ScalerWatch:
    """A Recorder's view of its GradScaler during a recorded step.

    Args:
        scaler: the Recorder's ``scaler`` (None: nothing to watch, every method is cheap).
    """

    def __init__(self, scaler) -> None:
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._handle = None
        self.begin()
        self.active = False  # (until a recorded step opens)

    def begin(self) -> None:
        """A recorded step opens."""
        self.active = True
        self._scale: torch.Tensor | None = None  # the scale at the end of the step's last backward
        self._stages: dict | None = None  # the scaler's per-optimizer stages then (``update`` replaces them)
        self._stepped = False  # the attached optimizer's step began inside the step
        self._unscaled_at_step = False  # ... with its gradients unscaled

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Sees ``optimizer.step()`` begin (a pre-hook, removed by :meth:`remove`), if there is a scaler."""
        self.remove()
        target = stepping_optimizer(optimizer) if self.scaler is not None else None
        if target is not None:
            self._handle = target.register_step_pre_hook(partial(_before_step, weakref.ref(self)))

    def remove(self) -> None:
        """Removes the optimizer hook."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def backward_ended(self) -> None:
        """A backward of the open step ended: its scale, kept (two device ops, no sync)."""
        if self.scaler is not None and self.active:
            scale = grad_scale(self.scaler)
            self._scale = None if scale is None else scale.clone()
            self._stages = self.scaler._per_optimizer_states

    def scale_now(self) -> torch.Tensor | None:
        """The scale the gradients hold now (the spike watch divides their norm by it): None
        without a scaler, or once ``scaler.unscale_`` ran (inside the closure, say)."""
        return None if params_unscaled(self.scaler) else grad_scale(self.scaler)

    def step_scale(self) -> torch.Tensor | None:
        """The scale the step's gradients carry (the last backward's), or None without a scaler."""
        return self._scale if self._scale is not None else grad_scale(self.scaler)

    def params_unscaled(self, warn: Callable[[str, str], None]) -> bool | None:
        """Whether the parameters' gradients at the step's end are already unscaled; None
        when that cannot be known (then their norms get no rows, and a warning says why).

        Args:
            warn: ``warn_once(topic, message)`` of the Recorder.
        """
        if self.scaler is None or params_unscaled(self.scaler) or self._unscaled_at_step:
            return True
        if self._stepped:  # the optimizer's step began with them scaled: a fused step unscales inside
            return False
        from torch.amp.grad_scaler import OptState

        stepped = any(s.get("stage") is OptState.STEPPED for s in self.scaler._per_optimizer_states.values())
        updated = self._stages is not None and self.scaler._per_optimizer_states is not self._stages
        if not (stepped or updated):
            return False
        if self._handle is not None:  # the attached optimizer skipped its step (inf/NaN): scaler.step unscaled them
            return True
        warn("scaler_step_inside", "scaler.step() ran inside the recorded step and the Recorder has no optimizer to "
             "see whether it unscaled the gradients (a plain optimizer's step does, a fused one's does not): "
             "param_grad_norm and grad_rms_over_eps have no rows for such steps; give the Recorder the optimizer "
             "(Recorder(..., optimizer=opt)) or call scaler.step/update after the step")
        return None

    def end(self) -> None:
        """The step closed."""
        self.active = False


def _before_step(watch_ref: weakref.ref, optimizer, args, kwargs) -> None:
    watch = watch_ref()
    if watch is not None and watch.active and watch._scale is not None:
        watch._stepped = True
        watch._unscaled_at_step = params_unscaled(watch.scaler)
