"""``update_ratio``: ‖Δθ‖/‖θ‖ per parameter group, measured around ``optimizer.step()``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from gradscope.recorder.params import ParamGroups
from gradscope.table.keys import Key


class UpdateRatioHooks:
    """Optimizer step hooks that measure the update of a recorded step.

    A group whose ‖θ‖ was 0 before the update (weights initialised to zero) has no ratio:
    no row, and a warning names it once; a group without parameters has no row either.

    Args:
        groups: the Recorder's parameter groups.
        emit: called with (step, keys, ratios) once the optimizer has stepped.
        warn: ``warn_once(topic, message)`` of the Recorder.
    """

    def __init__(self, groups: ParamGroups, emit: Callable[[int, list[Key], np.ndarray], None],
                 warn: Callable[[str, str], None] = lambda topic, message: None) -> None:
        self.groups, self.emit, self.warn = groups, emit, warn
        self.pending: int | None = None  # the recorded step whose update is measured next (:meth:`open`)
        self._before: list[torch.Tensor] | None = None
        self._stepping = False  # between the optimizer's pre- and post-step hooks
        self._handles: list = []

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hooks ``optimizer.step`` (replacing hooks on an earlier optimizer)."""
        self.remove()
        self._handles = [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_step_post_hook(self._after_step)]

    def remove(self) -> None:
        """Removes the optimizer hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def open(self, step: int) -> None:
        """A recorded step that wants ``update_ratio`` opens: the next optimizer step is its
        update. Opened inside ``optimizer.step(closure)`` (Lightning calls its hooks, and a
        spike replay, from the closure, which runs before the parameters change), the
        parameters are taken now."""
        self.pending = step
        if self._stepping:
            self._before = [p.detach().clone() for p in self.groups.params]

    def expire(self, step: int, warn: Callable[..., None]) -> None:
        """A new step opens: a recorded step whose optimizer never stepped (a GradScaler that
        skipped it on inf/NaN gradients, or an optimizer stepping every few steps) has no
        update, so no row, rather than the next step's update under its index."""
        if self.pending is not None and self.pending != step:
            warn("update_ratio_expired", f"no update_ratio row for step {self.pending}: the optimizer did not step "
                 f"before step {step} opened (a GradScaler skipped it on inf/NaN gradients, or the optimizer steps "
                 "every few steps); the update is measured around optimizer.step() inside the recorded step or "
                 "after it. Not reported again.")
            self.pending, self._before = None, None

    def _before_step(self, optimizer, args, kwargs) -> None:
        self._stepping = True
        if self.pending is not None:
            self._before = [p.detach().clone() for p in self.groups.params]

    def _after_step(self, optimizer, args, kwargs) -> None:
        self._stepping = False
        if self.pending is None or self._before is None:
            return
        now = [p.detach() for p in self.groups.params]
        if len(now) == len(self._before):
            delta = self.groups.group_norms(torch._foreach_sub(now, self._before))
            base = self.groups.group_norms(self._before)
            delta, base = delta.cpu().double().numpy(), base.cpu().double().numpy()
            keys, defined = self.groups.keys("update_ratio"), base > 0
            if not defined.all():
                zero = [k.site for k, d, p in zip(keys, defined, self.groups.populated) if p and not d]
                if zero:
                    self.warn("update_ratio_zero", f"update_ratio of group(s) {zero[:5]} is undefined at step "
                              f"{self.pending}: ‖θ‖ was 0 before the update (weights initialised to zero); no row for "
                              "them while it is. Not reported again.")
                keys = [k for k, d in zip(keys, defined) if d]
            self.emit(self.pending, keys, delta[defined] / base[defined])
        self.pending, self._before = None, None
