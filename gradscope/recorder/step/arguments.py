"""The Recorder's arguments checked where a mistake is made, not where it would surface later."""

from __future__ import annotations

import numbers
import warnings

import numpy as np
import torch
from torch import nn

from gradscope.recorder.discovery.layout import Layout
from gradscope.recorder.quantities.quantity import Quantity
from gradscope.recorder.quantities.registry import REGISTRY
from gradscope.table.keys import Key, model_key
from gradscope.user_frames import user_stacklevel


def checked_arguments(model, *, every, slow_every, optimizer, run) -> tuple[int, int]:
    """``(every, slow_every)`` as ints, after checking the Recorder's arguments whose mistakes
    would otherwise surface later and elsewhere.

    Raises:
        TypeError: ``model`` is no ``nn.Module``, ``optimizer`` has no ``param_groups``,
            ``run`` is no string.
        ValueError: ``every`` or ``slow_every`` is not an integer >= 1.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"Recorder: model must be a torch.nn.Module (or its torch.compile or DDP wrapper), "
                        f"got {type(model).__name__}")
    if optimizer is not None and not hasattr(optimizer, "param_groups"):
        raise TypeError(f"optimizer: the optimizer that steps this model (a torch.optim.Optimizer, with "
                        f"param_groups), got {optimizer!r}")
    if run is not None and not isinstance(run, str):
        raise TypeError(f"run: the run's name, a string, got {run!r}")
    for name, value in (("every", every), ("slow_every", slow_every)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    return int(every), int(slow_every)


def step_index(step, where: str = "Recorder.step") -> int:
    """A training step's index as an int (numpy integers too).

    Args:
        step: the index given.
        where: the call that got it, for the message.

    Raises:
        TypeError: ``step`` is not an integer (a float, a string, None, a bool).
        ValueError: ``step`` is negative (steps count from 0; ``micro_step`` -1 is the
            step's own row, no step is -1).
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"{where}: the step must be an integer (the global training step), got {step!r}")
    if step < 0:
        raise ValueError(f"{where}: the step must be >= 0 (the global training step, counted from 0), got {int(step)}")
    return int(step)


def loggable(quantity: str, value, *, lr_from_optimizer: bool) -> str:
    """``quantity`` if ``Recorder.log`` may write it: a name, not one the Recorder computes
    itself (two rows under one key, or one hidden; ``lr`` only while the Recorder reads it
    from the optimizer), with a number for a value.

    Raises:
        ValueError: an empty name, or one the Recorder computes.
        TypeError: the value is no number (nothing ``float()`` takes, or a bool or string)
            and no tensor.
    """
    if not isinstance(quantity, str) or not quantity:
        raise ValueError(f"Recorder.log: the quantity must be a non-empty name, got {quantity!r}")
    own = REGISTRY.get(quantity)
    written_by_log = getattr(own, "logged", False) or getattr(own, "logged_by_gradscope", False)
    if own is not None and not written_by_log and (quantity != "lr" or lr_from_optimizer):
        raise ValueError(f"Recorder.log({quantity!r}, ...): {quantity!r} is a quantity the Recorder computes itself"
                         + (" (from the optimizer it was given)" if quantity == "lr" else "")
                         + "; log your value under another name")
    if isinstance(value, (str, bytes, bool)) or not (isinstance(value, torch.Tensor) or hasattr(value, "__float__")):
        raise TypeError(f"Recorder.log({quantity!r}, ...): the value must be a number or a one-element tensor, "
                        f"got {type(value).__name__}")
    return quantity


def log_key(quantity: str, value, *, lr_from_optimizer: bool) -> tuple[Key, float | torch.Tensor]:
    """The row key and the value of ``Recorder.log(quantity, value)``, checked: a scalar
    (a number, or a tensor or array of one element; an array becomes its number) under a
    name :func:`loggable` takes.

    Raises:
        ValueError: the value has several elements, or the name is not loggable.
        TypeError: the value is no number.
    """
    elements = value.numel() if isinstance(value, torch.Tensor) else value.size if isinstance(value, np.ndarray) else 1
    if elements != 1:
        raise ValueError(f"Recorder.log({quantity!r}, ...): the value must be a scalar (a number, or a tensor or "
                         f"array of one element), got {type(value).__name__} of shape {tuple(value.shape)}")
    if isinstance(value, np.ndarray):
        value = value.item()  # (one element: np.array([2.5]))
    return model_key(loggable(quantity, value, lr_from_optimizer=lr_from_optimizer)), value


def warn_unmeasurable(quantities: dict[str, Quantity], named: set[str], layout: Layout) -> None:
    """Warns, once each, of the quantities asked for by name that have nothing to measure in
    this model (``ln_gain`` in a model without norms): they would give no row, silently."""
    for name in sorted(named):
        reason = quantities[name].nothing_to_measure(layout)
        if reason:
            warnings.warn(f"gradscope: {name} has nothing to measure in this model ({reason}): it will have no rows",
                          stacklevel=user_stacklevel())
