"""``Recorder.run`` and the spike watch's entry points, as a mixin of
:class:`~gradscope.recorder.recorder.Recorder`.

:meth:`StepRunner.run` opens a step, runs the user's closure (forward and backward of the
whole step) and closes it; with ``on_spike="replay"`` it hands the step to the watch
(:mod:`gradscope.recorder.replay.replay`), which may run the closure again, recorded. Callbacks
that open steps with ``begin_step``/``end_step`` call :meth:`StepRunner.check_spike`
instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradscope.recorder.replay.replay import Reading, SpikeWatch


class StepRunner:
    """The closure-running half of a :class:`~gradscope.recorder.recorder.Recorder` (its
    attributes and step methods are the Recorder's)."""

    def run(self, step: int, closure: Callable[[], Any], *, log_loss: bool = True) -> Any:
        """Runs one training step's forward and backward (all its micro-batches) as ``closure()``.

        The step is recorded when the schedule says so; with ``on_spike="replay"`` every step
        is watched and a spiking step the schedule skips is run again, recorded
        (:mod:`gradscope.recorder.replay.replay`), its gradients left as the first run made them.

        Args:
            step: the step's index.
            closure: forward and backward of the whole step; returns the step's loss (a 0-d
                tensor or a number). It may run again, so it must not fetch data itself, and
                the batch it captures must not be refilled in place while it may run.
            log_loss: log the returned loss as ``loss`` on recorded steps (False when the
                closure or the loop logs it).

        Returns:
            What the closure returned.
        """
        recorded = self.begin_step(step)
        begun = self._updates.begun
        try:
            out = closure()
            if log_loss and recorded and not self._closed:
                self.log("loss", out)
        except BaseException:
            self.abort_step()
            raise
        self.end_step()
        if self._replay is not None and self._updates.begun != begun:
            raise RuntimeError(f"Recorder.run: the closure of step {step} stepped the optimizer; with on_spike it runs "
                               "again on a spiking step, which would step it twice, and the watch would read the "
                               "gradients after the update. Call optimizer.step() and zero_grad() after rec.run returns "
                               "(the closure runs forward and backward only)")
        if self._replay is not None and not self._closed:
            self._replay.after(step, out, closure, recorded=recorded, log_loss=log_loss)
        return out

    def check_spike(self, step: int, loss: Any, rerun: Callable[[], Any], *, log_loss: bool = False) -> Reading:
        """The watch for callbacks that open steps with ``begin_step``/``end_step``: after
        ``end_step``, checks ``step``'s ``loss`` and gradient norm and replays it with
        ``rerun`` (forward and backward of the whole step again) when it spiked unrecorded.

        Raises:
            RuntimeError: the Recorder was made without ``on_spike``; a step is still open
                (call it after ``end_step``); the step was not opened with ``begin_step``.
        """
        if self._replay is None:
            raise RuntimeError("Recorder.check_spike: the Recorder was made without on_spike ('replay')")
        if self._step is not None:
            raise RuntimeError(f"Recorder.check_spike({step}): step {self._step} is still open; call check_spike "
                               "after end_step() (the replay opens the step again)")
        return self._replay.after(step, loss, rerun, recorded=self.records(step), log_loss=log_loss)

    @property
    def watch(self) -> SpikeWatch | None:
        """The spike watch (``watch.flagged``, ``watch.last``), or None without ``on_spike``."""
        return self._replay.watch if self._replay is not None else None

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The total gradient norm the watch took of the last step (0-d, on the device), for
        ``torch.nn.utils.clip_grads_with_norm_``; None without ``on_spike``. With a
        ``GradScaler`` it is divided by the scale: the norm after ``scaler.unscale_(opt)``."""
        return self._replay.grad_norm if self._replay is not None else None
