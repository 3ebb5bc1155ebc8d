"""One Recorder's open step: :class:`StepSession` opens it (arming the capture when the
schedule records it), takes what the loop logs into its device buffer, and ends it (the
quantities collect, one host transfer, rows queued) or discards it."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import torch

from gradscope.recorder.capture.capture import Capture
from gradscope.recorder.capture.compile_settings import DonationOff
from gradscope.recorder.capture.scaler_watch import ScalerWatch
from gradscope.recorder.capture.step_buffer import StepBuffer
from gradscope.recorder.capture.optimizer_step import UPDATE_QUANTITIES, OptimizerStepHooks
from gradscope.recorder.quantities.quantity import Quantity
from gradscope.recorder.rows.late_rows import LateRows
from gradscope.recorder.rows.outlet import Outlet
from gradscope.recorder.step.arguments import step_index
from gradscope.recorder.step.checks import StepChecks
from gradscope.recorder.step.step_end import StepEnd
from gradscope.table.keys import Key


class StepSession:
    """Which step is open, whether it records, what it takes, and its device buffer.

    Args:
        capture: the Recorder's capture (armed for a recorded step).
        checks, late, outlet, updates, scaler_watch, end: the Recorder's other parts.
        quantities: the Recorder's quantities; ``named``: those asked for by name.
        every, slow_every: the schedule (``Recorder(every=, slow_every=)``).
        cosine_tokens, generator: what ``cosine`` samples with.
        device: returns the device the step's values live on.
    """

    def __init__(self, *, capture: Capture, checks: StepChecks, late: LateRows, outlet: Outlet,
                 updates: OptimizerStepHooks, scaler_watch: ScalerWatch, end: StepEnd, quantities: dict[str, Quantity],
                 named: set[str], every: int, slow_every: int, cosine_tokens: int, generator: torch.Generator,
                 device: Callable[[], torch.device]) -> None:
        self.capture, self.checks, self.late, self.outlet = capture, checks, late, outlet
        self.updates, self.scaler_watch, self.step_end = updates, scaler_watch, end
        self.quantities, self.named, self.every, self.slow_every = quantities, named, every, slow_every
        self.cosine_tokens, self.generator, self.device = cosine_tokens, generator, device
        self.step: int | None = None  # the open step
        self.recording = False  # the open step records
        self.wants: set[str] = set()  # the quantities the open step takes
        self.buffer: StepBuffer | None = None  # its device values, while it records
        self._donation_off = [False]  # whether this session's open step holds DonationOff
        weakref.finalize(self, DonationOff.give_back, self._donation_off)  # (a Recorder collected inside a step)

    def records(self, step: int) -> bool:
        """Whether the schedule records ``step``."""
        return step % self.every == 0

    def open(self, step: int, *, replay: bool, optimizer: torch.optim.Optimizer | None) -> bool:
        """Opens ``step`` (the caller checked that none is open); returns whether it records.
        ``replay``: record it whatever the schedule, with every quantity."""
        self.step = step
        self.updates.expire(step, self.checks.warn_once)
        if not (replay or self.records(step)):
            self.outlet.ran(step)  # (a resumed run that runs a step owns it in log_dir: recorded or not)
            return False
        self.checks.begin(step)
        self.late.begin(step)
        slow = replay or step % (self.every * self.slow_every) == 0
        self.wants = {n for n, q in self.quantities.items() if slow or not q.slow}
        if UPDATE_QUANTITIES & self.wants and optimizer is not None:
            self.updates.open(step)  # the next optimizer.step(), inside the step or after it
        elif UPDATE_QUANTITIES & self.wants & set(self.named):
            asked = sorted(UPDATE_QUANTITIES & self.wants & set(self.named))
            self.checks.warn_once("update_ratio", f"{' and '.join(asked)} {'is' if len(asked) == 1 else 'are'} measured "
                                  "around optimizer.step(): give the "
                                  "Recorder the optimizer (Recorder(model, optimizer=opt), or rec.attach_optimizer(opt)); "
                                  "until then no rows")
        captures = set().union(*(self.quantities[q].captures for q in self.wants))
        stats = any(n in self.wants for n in self.step_end.value_stats + self.step_end.grad_stats)
        self.buffer = StepBuffer()
        self.scaler_watch.begin()
        self.updates.step_opened()
        self.capture.begin(self.device(), captures, cosine_tokens=self.cosine_tokens, generator=self.generator,
                           stats=stats)
        DonationOff.take(self._donation_off)  # (a recorded graph's backward may run twice: capture/compile_settings.py)
        self.recording = True
        return True

    def close(self, *, optimizer: torch.optim.Optimizer | None) -> None:
        """Ends the open step after backward: a recorded step's values go to the host and its rows are queued."""
        step = self.step
        try:
            if self.recording:
                host = self.step_end.finish(step, self.wants, self.buffer, optimizer=optimizer,
                                        lr_used=self.updates.lr_used)
                self.late.step(step, host, now=self.checks.awaiting_hooks)  # (until a hook fired: checked now)
        finally:
            self.capture.on = False
            self.scaler_watch.end()
            self.updates.step_closed()
            self._forget()

    def discard(self) -> None:
        """Discards the open step (after an exception): nothing stored."""
        self.capture.discard()
        self.scaler_watch.end()
        self.updates.step_closed(discarded=True)
        self._forget()

    def _forget(self) -> None:
        self.step, self.buffer, self.recording = None, None, False
        DonationOff.give_back(self._donation_off)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside, the open step records nothing."""
        capture, was = self.capture, self.capture.on
        capture.on = False
        try:
            yield
        finally:
            capture.on = was and self.recording

    def log(self, key: Key, value: float | torch.Tensor, step: int | None) -> bool:
        """Puts a logged value in the open recorded step's buffer (``step`` None or the open
        one); returns False when it is not for that buffer."""
        if self.buffer is None or step not in (None, self.step):
            return False
        if isinstance(value, torch.Tensor):
            self.buffer.add(key, value.detach().float().reshape(()))
        else:
            self.buffer.add_float(key, value)
        return True

    def log_later(self, key: Key, value: float | torch.Tensor, step: int) -> None:
        """A value logged for ``step`` outside its recorded step: stored at once.

        Raises:
            TypeError, ValueError: ``step`` is no integer, or is negative.
        """
        self.late.rows(step_index(step, "Recorder.log(step=...)"), [key], np.array([float(value)]))
