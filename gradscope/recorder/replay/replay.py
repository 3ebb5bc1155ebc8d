"""Replay a spike: watch every step cheaply; when one spikes, record that very step in full.

``Recorder(model, optimizer=opt, every=100, on_spike="replay")`` with ``rec.run``::

    for step, batch in enumerate(loader):
        loss = rec.run(step, lambda: train_step(batch))  # forward + backward of the whole step
        opt.step(); opt.zero_grad()

**The watch** (:class:`SpikeWatch`), every step, after the closure's backward: the step's
loss and the total gradient norm ‖g‖ over every parameter gradient (one reduction,
``torch.nn.utils.get_total_norm``, the function ``clip_grad_norm_`` uses, so
``torch.nn.utils.clip_grads_with_norm_(params, max_norm, rec.grad_norm)`` reuses it and
clips exactly as ``clip_grad_norm_`` would). Both stay on the device until one transfer of
the two numbers, the one host sync the watch needs (the verdict is due before the loop's
``optimizer.step()``). The rule is the ``spike`` quantity's (:mod:`gradscope.recorder.quantities.spike`):
z = (ln v − median)/(1.4826·MAD) > 6 over the logs of the series' previous ``window`` (128)
finite positive values, with a verdict once ``min_history`` (16, not half the window) values
are in; a spike stays in the window. With a ``GradScaler`` the norm is divided by its scale first.

**The replay** (:class:`SpikeReplay`), on a flagged step the schedule did not record: the
RNG states taken before the closure (torch CPU and every initialised CUDA device, Python's
``random``, NumPy's global generator) are restored, the step's gradients are set aside
(``p.grad = None``), the closure runs again recorded with every quantity of the Recorder
(slow ones too, as on a ``slow_every`` step), and afterwards the original gradient tensors,
the model's buffers (as the original forward left them) and the RNG states (as after the
original closure) are put back: training goes on exactly as without the watch. The table
gets the step's full rows, a ``replay`` row (site ``""``, value: the watch's z-score, the
larger of loss's and ‖g‖'s when both spiked) and, when the replayed loss or ‖g‖ differs
from the original (non-deterministic kernels, a closure with side effects), a warning and
a ``replay_mismatch`` row (value: the larger relative difference), rows kept.

Only references to what the closure captures are held, and only during ``rec.run``: a loop
that refills its batch tensors in place must hand the closure a copy.

Under ``torch.distributed`` the two numbers are averaged over the ranks before the rule
reads them (one ``all_reduce``), so every rank takes the same decision and all replay the
step together (:mod:`.ranks`).
"""

from __future__ import annotations

import math
import operator
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from gradscope.recorder.capture.params import ParamGroups
from gradscope.recorder.quantities.spike import SIGMAS, WINDOW, SpikeDetector
from gradscope.recorder.replay import ranks
from gradscope.table.keys import model_key

ON_SPIKE: tuple[str, ...] = ("replay",)
"""The values ``Recorder(on_spike=...)`` takes besides None and a :class:`ReplayOptions`."""
MIN_HISTORY = 16
SERIES = ("loss", "grad_norm")


@dataclass(frozen=True, kw_only=True)
class ReplayOptions:
    """The watch's rule (``Recorder(on_spike=ReplayOptions(window=64))``; ``"replay"`` is the default).

    Attributes:
        window: previous steps per series (default 128, OLMo-core's).
        min_history: finite previous values needed before a verdict (default 16).
        sigmas: threshold on the robust z-score, (ln v − median)/(1.4826·MAD) of the window's logs (default 6).
    """

    window: int = WINDOW
    min_history: int = MIN_HISTORY
    sigmas: float = SIGMAS

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 4:
            raise ValueError(f"ReplayOptions.window: must be an integer >= 4, got {self.window!r}")
        if not isinstance(self.min_history, int) or not 2 <= self.min_history <= self.window:
            raise ValueError(f"ReplayOptions.min_history: must be an integer between 2 and window={self.window}, "
                             f"got {self.min_history!r}")
        if not self.sigmas > 0:
            raise ValueError(f"ReplayOptions.sigmas: must be > 0, got {self.sigmas!r}")


def replay_options(on_spike: str | ReplayOptions | None) -> ReplayOptions | None:
    """The options of ``Recorder(on_spike=...)``, or None (no watch).

    Raises:
        ValueError: naming the bad value and the valid ones.
    """
    if on_spike is None:
        return None
    if isinstance(on_spike, ReplayOptions):
        options = on_spike
    elif on_spike in ON_SPIKE:
        options = ReplayOptions()
    else:
        raise ValueError(f"on_spike: must be one of {[*ON_SPIKE, None]} or a gradscope.ReplayOptions, "
                         f"got {on_spike!r}")
    return options


@dataclass(frozen=True)
class Reading:
    """What the watch saw at one step: the loss, ‖g‖, the z-score of each series that
    spiked (NaN for one that did not) and whether the step was flagged."""

    step: int
    loss: float
    grad_norm: float
    z_loss: float
    z_grad_norm: float
    flagged: bool

    @property
    def z(self) -> float:
        """The z-score of the series that spiked (the larger one when both did)."""
        return max((z for z in (self.z_loss, self.z_grad_norm) if z == z), default=math.nan)


class SpikeWatch:
    """The spike rule on two series, the step's loss and total gradient norm.

    Args:
        options: window, history and threshold.
    """

    def __init__(self, options: ReplayOptions) -> None:
        self.options = options
        self._rule = SpikeDetector(options.window, options.sigmas, watch=SERIES, min_history=options.min_history)
        self._keys = [model_key(s) for s in SERIES]
        self.flagged: list[Reading] = []
        self.last: Reading | None = None

    def state_dict(self) -> dict:
        """The rule's windows (a checkpoint); each flagged step has a ``replay`` row in the table."""
        return self._rule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restores the windows :meth:`state_dict` saved."""
        self._rule.load_state_dict(state)

    def observe(self, step: int, loss: float, grad_norm: float) -> Reading:
        """Checks one step's values against the windows, then adds them."""
        zs = []
        for key, value in zip(self._keys, (loss, grad_norm)):
            hits, z = self._rule.rows([key], np.array([value]))  # one series at a time: the hit names no series
            zs.append(float(z[0]) if hits else math.nan)
        reading = Reading(step, loss, grad_norm, zs[0], zs[1], any(z == z for z in zs))
        if reading.flagged:
            self.flagged.append(reading)
        self.last = reading
        return reading


class RngStates:
    """The global random states a closure may draw from: torch's CPU generator, every
    initialised CUDA device's, Python's ``random`` and NumPy's global generator."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.python = random.getstate()
        self.numpy = np.random.get_state()

    def restore(self) -> None:
        """Puts every state back."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        np.random.set_state(self.numpy)


def total_grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """‖g‖₂ over every parameter that has a gradient (``clip_grad_norm_``'s reduction; over
    DTensor gradients on several meshes, :func:`.ranks.total_grad_norm`'s)."""
    return ranks.total_grad_norm([p.grad for p in params if p.grad is not None])


class Recording(Protocol):
    """What a replay needs of the Recorder it replays for: its step methods, ``log``, the
    parameter groups the watch reads and the attached optimizer."""

    groups: ParamGroups
    optimizer: torch.optim.Optimizer | None

    def begin_step(self, step: int, *, replay: bool = False) -> bool: ...

    def end_step(self) -> None: ...

    def abort_step(self) -> None: ...

    def log(self, quantity: str, value, *, step: int | None = None) -> None: ...


class SpikeReplay:
    """A Recorder's ``on_spike="replay"``: the watch, the RNG states, and the replay.

    Args:
        recorder: the Recorder (its public step methods record the replay).
        model: the recorded model (its parameters' gradients and its buffers).
        options: the watch's rule.
        grad_scale: returns the GradScaler's current scale as a 0-d tensor, or None.
    """

    def __init__(self, recorder: Recording, model: nn.Module, options: ReplayOptions,
                 grad_scale: Callable[[], torch.Tensor | None]) -> None:
        self.recorder, self.model, self.grad_scale = recorder, model, grad_scale
        self.watch = SpikeWatch(options)
        self.grad_norm: torch.Tensor | None = None
        self._rng: RngStates | None = None
        self._extra: tuple | None = None  # (optimizer key, the model's parameters, the optimizer's others)

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters whose gradients the watch reads and a replay sets aside: the model's
        now, read live through the Recorder's parameter groups (``fully_shard`` and
        ``load_state_dict(assign=True)`` put new parameter objects in place: a list kept
        from construction would give a norm of 0 and a replay that clears the wrong
        gradients), then those of the attached optimizer that the model does not hold (a
        head or a loss's parameters outside it: left in place, a replay would add its
        gradients to theirs)."""
        params = self.recorder.groups.params
        optimizer = self.recorder.optimizer
        if optimizer is None:
            return params
        groups = getattr(optimizer, "param_groups", ())
        key = (id(optimizer), [(id(g["params"]), len(g["params"])) for g in groups])
        kept = self._extra  # (found again only when the optimizer's groups or the model's parameters changed:
        if (kept is None or kept[0] != key or len(kept[1]) != len(params)  # the watch reads them every step)
                or not all(map(operator.is_, params, kept[1]))):
            held = set(map(id, params))
            extra = list({id(p): p for g in groups for p in g["params"] if id(p) not in held}.values())
            kept = self._extra = (key, params, extra)
        return params + kept[2] if kept[2] else params

    def before(self) -> None:
        """Takes the RNG states, before the step's closure runs."""
        self._rng = RngStates()

    def _values(self, loss) -> tuple[torch.Tensor, torch.Tensor]:
        """‖g‖ (a DTensor when ``clip_grad_norm_``'s is one) and the two numbers the watch
        judges: the loss and ‖g‖, each averaged over the ranks (one ``all_reduce``)."""
        norm = total_grad_norm(self.params)
        scale = self.grad_scale()
        watched = ranks.plain(norm) / scale.to(norm.device) if scale is not None else norm
        norm = ranks.plain(watched)
        if isinstance(loss, torch.Tensor) and loss.numel() != 1:
            raise TypeError(f"Recorder.run: the closure must return the step's loss (a 0-d tensor or a number), got a "
                            f"tensor of shape {tuple(loss.shape)} (reduce it, e.g. loss.mean(), as backward() needs)")
        if isinstance(loss, torch.Tensor):
            value = ranks.plain(loss.detach()).float().reshape(()).to(norm.device)  # (a DTensor under loss_parallel)
        elif isinstance(loss, (int, float)):
            value = torch.tensor(float(loss), device=norm.device)
        else:
            raise TypeError(f"Recorder.run: the closure must return the step's loss (a 0-d tensor or a number), "
                            f"got {type(loss).__name__}")
        return watched, ranks.mean_over_ranks(torch.stack([value, norm.float()]))

    def after(self, step: int, loss, rerun: Callable[[], object], *, recorded: bool, log_loss: bool) -> Reading:
        """Watches the step just run; replays it when it spiked and was not recorded.

        Args:
            step: the step's index.
            loss: what the closure returned (the step's loss).
            rerun: runs the step's forward and backward again (the closure).
            recorded: whether the schedule recorded the step already.
            log_loss: log the replay's returned loss as ``loss``.

        Returns:
            The watch's reading of the step.
        """
        if self._rng is None:  # (at every step, not first at a spike hours into the run)
            raise RuntimeError(f"Recorder: step {step} is watched but its RNG states were not taken before it ran "
                               "(open the step with rec.run or rec.begin_step, then call check_spike after end_step)")
        watched, values = self._values(loss)
        self.grad_norm = watched  # (divided by a GradScaler's scale: the norm of the gradients unscale_ leaves)
        loss_value, norm_value = values.tolist()  # the watch's one host sync
        reading = self.watch.observe(step, loss_value, norm_value)
        if reading.flagged and not recorded:
            self._replay(reading, rerun, log_loss)
        elif reading.flagged:  # (recorded by the schedule already: its rows are there; the flag too)
            self.recorder.log("replay", reading.z, step=step)
        self._rng = None
        return reading

    def _replay(self, reading: Reading, rerun: Callable[[], object], log_loss: bool) -> None:
        rec, step = self.recorder, reading.step
        after = RngStates()
        params = self.params
        grads = [p.grad for p in params]
        # each buffer slot's tensor and its values: a forward that assigns a new tensor
        # (``self.ema = 0.9 * self.ema + ...``) is undone by putting the tensor back
        buffers = [(m._buffers, name, b, b.detach().clone()) for m in self.model.modules()
                   for name, b in m._buffers.items() if b is not None]
        for p in params:
            p.grad = None
        self._rng.restore()
        try:
            rec.begin_step(step, replay=True)
            try:
                out = rerun()
                if log_loss:
                    rec.log("loss", out)
                rec.log("replay", reading.z)
                _, again = self._values(out)
            except BaseException:
                rec.abort_step()
                raise
            rec.end_step()
        finally:
            for p, g in zip(params, grads):
                p.grad = g
            with torch.no_grad():
                for slots, name, b, saved in buffers:
                    slots[name] = b
                    b.copy_(saved)
            after.restore()
        loss_again, norm_again = again.tolist()
        diff = max(_relative(loss_again, reading.loss), _relative(norm_again, reading.grad_norm))
        if diff > 0:
            warnings.warn(f"gradscope: the replay of step {step} differs from the step as it ran by {diff:.3g} relative "
                          f"(loss {reading.loss:.9g} -> {loss_again:.9g}, gradient norm {reading.grad_norm:.9g} -> "
                          f"{norm_again:.9g}: "
                          "non-deterministic kernels, or a closure with side effects); its rows are kept, with a "
                          "replay_mismatch row (the larger relative difference)", stacklevel=4)
            rec.log("replay_mismatch", diff, step=step)


def _relative(a: float, b: float) -> float:
    """|a − b| / |b| (0 when equal, NaN-safe: two NaNs are equal here)."""
    if a == b or (a != a and b != b):
        return 0.0
    return abs(a - b) / abs(b) if b != 0 and math.isfinite(b) else math.inf
