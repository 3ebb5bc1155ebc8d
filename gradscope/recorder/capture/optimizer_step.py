"""The Recorder's optimizer step hooks: the update of a recorded step (‖Δθ‖ and ‖θ‖ per
parameter group around ``optimizer.step()``, for ``update_ratio`` and ``update_rms``), the ``lr`` that a step
inside the recorded step used, and how many steps began (``Recorder.run``'s check)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from gradscope.recorder.capture.params import ParamGroups, is_dtensor
from gradscope.table.keys import Key


UPDATE_QUANTITIES = frozenset({"update_ratio", "update_rms"})
"""The quantities measured by these hooks (their classes make rows with ``update_rows``)."""


class Update(NamedTuple):
    """One measured update of a recorded step, per parameter group (``groups.keys`` order)."""

    step: int  # the recorded step
    keys: list[Key]  # the groups' keys under ``update_ratio``
    delta: np.ndarray  # ‖Δθ‖ of each group
    base: np.ndarray  # ‖θ‖ before the update
    elsewhere: np.ndarray  # bool: the group holds trainable parameters the optimizer does not step
    populated: list[bool]  # the group has parameters
    sizes: np.ndarray | None = None  # elements in each group (update_rms)


class OptimizerStepHooks:
    """Optimizer step hooks that measure the update of a recorded step.

    Args:
        groups: the Recorder's parameter groups.
        emit: called with the :class:`Update` once the optimizer has stepped (the
            ``update_ratio`` quantity makes its rows).
        warn: ``warn_once(topic, message)`` of the Recorder.
    """

    def __init__(self, groups: ParamGroups, emit: Callable[[Update], None],
                 warn: Callable[[str, str], None] = lambda topic, message: None) -> None:
        self.groups, self.emit, self.warn = groups, emit, warn
        self.pending: int | None = None  # the recorded step whose update is measured next (:meth:`open`)
        self.step_open = False  # a recorded step is open (:meth:`step_opened`, :meth:`step_closed`)
        self.lr_used = None  # the first group's lr when the optimizer stepped inside the open recorded step
        self._before: list[torch.Tensor] | None = None
        self._stepping = False  # between the optimizer's pre- and post-step hooks
        self.begun = 0  # optimizer steps begun since the hooks were attached (Recorder.run's check)
        self._handles: list = []

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hooks ``optimizer.step`` (replacing hooks on an earlier optimizer); nothing for an
        optimizer whose steps fire no hooks (then no ``update_ratio`` rows, said by :meth:`expire`)."""
        self.remove()
        target = stepping_optimizer(optimizer)
        if target is not None:
            self._handles = [target.register_step_pre_hook(self._before_step),
                             target.register_step_post_hook(self._after_step)]

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

    def step_opened(self) -> None:
        """A recorded step opens (an update inside it reads its lr afresh)."""
        self.step_open, self.lr_used = True, None

    def step_closed(self, *, discarded: bool = False) -> None:
        """The open recorded step ends; ``discarded``: it was aborted, so no update is measured for it."""
        self.step_open = False
        if discarded:
            self.pending = None

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
        self.begun += 1
        if self.step_open:  # (the lr this update uses: a scheduler stepping inside the step changes it before it ends)
            lr = optimizer.param_groups[0]["lr"]
            self.lr_used = lr.detach().clone() if isinstance(lr, torch.Tensor) else lr
        if self.pending is not None:
            self._before = [p.detach().clone() for p in self.groups.params]

    def _after_step(self, optimizer, args, kwargs) -> None:
        self._stepping = False
        if self.pending is None or self._before is None:
            return
        now = [p.detach() for p in self.groups.params]
        if len(now) == len(self._before):
            if any(map(is_dtensor, now)):  # (foreach ops refuse DTensors beside plain tensors or over several meshes)
                diff = [a - b for a, b in zip(now, self._before)]
            else:
                diff = torch._foreach_sub(now, self._before)
            delta = self.groups.group_norms(diff)
            base = self.groups.group_norms(self._before)
            delta, base = torch.stack([delta, base]).cpu().double().numpy()  # (one transfer)
            owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
            others = [p.requires_grad and id(p) not in owned for p in self.groups.params]
            elsewhere = np.asarray(self.groups.any_member(others)) if any(others) else np.zeros(len(base), dtype=bool)
            self.emit(Update(self.pending, self.groups.keys("update_ratio"), delta, base, elsewhere,
                             list(self.groups.populated), self.groups.host_sums([p.numel() for p in now])))
        self.pending, self._before = None, None


def update_rows(quantities: dict, update: Update, warn: Callable[[str, str], None]) -> tuple[list[Key], np.ndarray]:
    """The rows of one measured update for every quantity that makes them (``update_ratio``,
    ``update_rms``), in the Recorder's order."""
    keys: list[Key] = []
    values = []
    for q in quantities.values():
        if hasattr(q, "update_rows"):
            k, v = q.update_rows(update, warn)
            keys += k
            values.append(np.asarray(v, dtype=np.float64))
    return keys, np.concatenate(values) if values else np.zeros(0)


def stepping_optimizer(optimizer) -> torch.optim.Optimizer | None:
    """The optimizer whose ``step`` fires step hooks: ``optimizer`` itself, or the one a wrapper
    holds as ``.optimizer`` (accelerate's ``AcceleratedOptimizer``, which the HF Trainer hands
    its callbacks, keeps no hooks of its own); None if neither does."""
    for _ in range(4):
        if hasattr(optimizer, "_optimizer_step_pre_hooks"):
            return optimizer
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            return None
        optimizer = inner
    return None
