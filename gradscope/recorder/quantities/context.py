"""What a quantity sees at the end of a recorded step: :class:`StepContext`.

A quantity's :meth:`~gradscope.recorder.quantities.quantity.Quantity.collect` gets one, after the
step's backward and before its one host transfer, so before the loop's ``optimizer.step()``:
optimizer state read there is the previous step's (none at the first step). It offers the model, its parameter
groups and gradients, the optimizer, the built-in captures, a way to add values under row
keys, and once-only warnings; never the Recorder itself.
"""

from __future__ import annotations

import itertools
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradscope.recorder.discovery.layout import Layout
from gradscope.recorder.capture.params import ParamGroups
from gradscope.recorder.capture.step_buffer import StepBuffer
from gradscope.table.keys import Key, model_key
from gradscope.user_frames import user_stacklevel

if TYPE_CHECKING:
    from gradscope.recorder.capture.capture import Capture


@dataclass
class StepContext:
    """The end of one recorded step, as a quantity's ``collect`` sees it.

    Attributes:
        step: the step's index.
        model: the recorded model (unwrapped from DDP / ``torch.compile``).
        layout: its sites, norms, stacks and parameter groups.
        groups: the parameter groups of ``param_grad_norm``: ``groups.params``,
            ``groups.grads()``, ``groups.keys(quantity)``, ``groups.group_norms(...)``.
        optimizer: the optimizer given to the Recorder, or None.
        lr_from_optimizer: whether ``lr`` is read from ``optimizer`` (it was given to the
            constructor, not attached by a training loop that logs ``lr`` itself).
        device: the device of the model's first parameter.
        lr_used: the first group's lr when the optimizer stepped inside this step (a
            scheduler stepping after it changes ``param_groups`` before the step ends), else None.
    """

    step: int
    model: nn.Module
    layout: Layout
    groups: ParamGroups
    optimizer: torch.optim.Optimizer | None
    lr_from_optimizer: bool
    device: torch.device
    capture: Capture = field(repr=False)
    buffer: StepBuffer = field(repr=False)
    warned: set[str] = field(repr=False)
    lr_used: float | torch.Tensor | None = None
    current: Any = field(default=None, repr=False)  # the Quantity collecting now (its name checks the keys it adds)
    _cache: dict = field(default_factory=dict, repr=False)

    def _own(self, quantities: set[str]) -> None:
        q = self.current
        if q is not None and not quantities <= set(q.names):
            raise ValueError(f"{type(q).__name__}.collect added values under {sorted(quantities - set(q.names))}: a "
                             f"quantity adds rows under its own name ({q.name!r}, or also_names)")

    # -- adding values ---------------------------------------------------------------------------
    def add(self, key: Key, value: torch.Tensor | float) -> None:
        """One value (a 0-d tensor, kept on its device, or a float) under ``key``."""
        self._own({key.quantity})
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise TypeError(f"StepContext.add({key.quantity!r}): one number per key, got a tensor of shape "
                                f"{tuple(value.shape)} (add_many takes one value per key)")
            self.buffer.add(key, value.detach().float().reshape(()))
        else:
            self.buffer.add_float(key, value)

    def add_model_value(self, quantity: str, value: torch.Tensor | float) -> None:
        """One model-level value (no stack, layer or site), as ``loss`` or ``lr`` have."""
        self.add(model_key(quantity), value)

    def add_many(self, keys: list[Key], values: torch.Tensor) -> None:
        """A 1-d tensor of values, one per key."""
        self._own({k.quantity for k in keys})
        if values.numel() != len(keys):
            who = f"{type(self.current).__name__}.collect: " if self.current is not None else ""
            raise ValueError(f"{who}StepContext.add_many: {len(keys)} keys but {values.numel()} values (one value per "
                             f"key, of quantity {sorted({k.quantity for k in keys})})")
        self.buffer.add_many(keys, values)

    def add_matrix(self, stack: str, site: str, quantity: str, matrix: torch.Tensor) -> None:
        """A matrix: row i, column j become rows with ``layer=i``, ``layer_j=j``."""
        self._own({quantity})
        self.buffer.add_matrix(-1, stack, site, quantity, matrix)

    def add_block(self, name: str, values: torch.Tensor) -> None:
        """A raw array that travels with the step's values (its quantity's ``rows`` reads it
        from ``data.blocks[name]``)."""
        self.buffer.add_block(name, values)

    # -- what is there to read ---------------------------------------------------------------
    def once(self, name: str, compute: Callable[[], Any]) -> Any:
        """``compute()`` the first time this step asks for ``name``, the same value after: what
        several quantities read (‖θ‖ per group, Adam's √v) is computed once a step."""
        if name not in self._cache:
            self._cache[name] = compute()
        return self._cache[name]

    def param_grad_squares(self) -> torch.Tensor | None:
        """‖p.grad‖² per parameter (``groups.params`` order, 0 without a gradient), computed
        once per step; None when no parameter has a gradient."""
        if "param_grad_squares" not in self._cache:
            self._cache["param_grad_squares"] = self.groups.squared_norms(self._grads())
        return self._cache["param_grad_squares"]

    def group_grad_norms(self) -> torch.Tensor | None:
        """‖grad‖ per parameter group (``groups.keys(...)`` order), computed once per step;
        None when no parameter has a gradient."""
        if "group_grad_norms" not in self._cache:
            sq = self.param_grad_squares()
            self._cache["group_grad_norms"] = None if sq is None else (self.groups.membership(sq.device) @ sq).sqrt()
        return self._cache["group_grad_norms"]

    def has_grads(self) -> list[bool]:
        """Per parameter (``groups.params`` order): whether it has a gradient now."""
        return [g is not None for g in self._grads()]

    def _grads(self) -> list:
        """Every parameter's ``.grad`` now (read once per step)."""
        if "grads" not in self._cache:
            self._cache["grads"] = self.groups.grads()
        return self._cache["grads"]

    def groups_with_grads(self) -> list[bool]:
        """Per parameter group: whether any of its parameters has a gradient (a frozen
        group's norm is not 0.0 but absent). Host-side, no device work."""
        if "with_grads" not in self._cache:
            grads = self._grads()
            if any(map(operator.is_, grads, itertools.repeat(None))):
                self._cache["with_grads"] = self.groups.any_member(self.has_grads())
            else:  # (every parameter has one: the usual step)
                self._cache["with_grads"] = list(self.groups.populated)
        return self._cache["with_grads"]

    @property
    def signals(self):
        """The forward signals' capture (attention, sub-layer RMS, output logits):
        :class:`gradscope.recorder.capture.signals.Signals`."""
        return self.capture.signals

    @property
    def routers(self):
        """The MoE routers' capture (:class:`gradscope.recorder.capture.routers.RouterCapture`),
        or None when no quantity of the Recorder captures ``router``."""
        return self.capture.routers

    def cosine_matrices(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Stack -> (cosine matrix, which layers were written) of the sampled layer outputs."""
        return self.capture.cosine.matrices()

    # -- telling the user ---------------------------------------------------------------------
    def warn_once(self, topic: str, message: str) -> None:
        """Warns with ``message`` the first time ``topic`` comes up for this Recorder."""
        if topic not in self.warned:
            self.warned.add(topic)
            warnings.warn(f"gradscope: {message}", stacklevel=user_stacklevel())
