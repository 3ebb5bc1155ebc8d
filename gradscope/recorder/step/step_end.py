"""The end of a recorded step, as a mixin of :class:`~gradscope.recorder.recorder.Recorder`:
:meth:`StepEnd._finish` lets each quantity add its device values to the step's buffer and
takes them to the host in the step's one transfer; :meth:`StepEnd._rows` turns those host
values into rows later (:class:`~gradscope.recorder.rows.late_rows.LateRows` calls it, in bulk).
"""

from __future__ import annotations

import contextlib

import torch
import numpy as np

from gradscope.recorder.quantities.context import StepContext
from gradscope.recorder.step.finish import SCALE, host_marks, step_rows
from gradscope.table.keys import model_key


class StepEnd:
    """The end-of-step half of a :class:`~gradscope.recorder.recorder.Recorder` (its
    attributes are the Recorder's)."""

    def _finish(self, step: int, wants: set[str]) -> None:
        buf = self._buffer
        with no_autocast(self._capture.device):  # leaving the step inside autocast must not lower precision
            snapshots, calls = self._capture.end()
            scale = self._scaler_watch.step_scale()  # (the backward's: scaler.update() may have run since)
            if scale is not None:
                buf.add(model_key(SCALE), scale)
            ctx = StepContext(step, self.model, self.layout, self.groups, self.optimizer, self._lr_from_optimizer,
                              self._capture.device, self._capture, buf, self._checks.warned, lr_used=self._updates.lr_used)
            for name, quantity in self._quantities.items():
                if name in wants:
                    ctx.current = quantity
                    if quantity.collect(ctx) is not None:
                        raise TypeError(f"{type(quantity).__name__}.collect returned a value, which records nothing: "
                                        "add values with ctx.add(key, value), ctx.add_many or ctx.add_model_value")
            if "lr" in wants and self.optimizer is None and "lr" in self._named:
                self._lr_unlogged()
            buf.add_block("snapshots", [t for g, f, _, _ in snapshots for t in (g, f)], (len(snapshots), -1))
            values = buf.transfer()  # the one host transfer of this step
        host = (values, [(m, r) for _, _, m, r in snapshots], wants, calls,
                self._scaler_watch.params_unscaled(self._checks.warn_once),
                self._capture.backwards, self._capture.grad_forwards, self._capture.forwards)
        self._late.step(step, host, now=not self._checks.ever_seen)  # (until a hook fired: checked now)

    def _rows(self, step: int, host: tuple) -> tuple[list, np.ndarray]:
        """The rows of one recorded step from its host values (:class:`LateRows` calls it)."""
        transferred, marks, wants, calls, params_unscaled, backwards, grad_forwards, forwards = host
        keys, values, blocks = transferred.arrays()
        blocks["marks"], blocks["reached"] = host_marks(marks, self._capture.n_taps)
        keys, values, data = step_rows(keys, values, blocks, layout=self.layout, points=self._capture.points,
                                       K=self._capture.K, quantities=self._quantities, wants=wants,
                                       params_unscaled=params_unscaled, backwards=backwards, grad_forwards=grad_forwards,
                                       forwards=forwards, call_counts=calls,
                                       value_stats=self._value_stats, grad_stats=self._grad_stats,
                                       width=self._capture.width, key_cache=self._key_cache)
        self._checks.after(step, data, calls, wants)
        self._checks.merged(step, [n for n in self._quantities if n in wants and self._quantities[n].merged_away(data)])
        return keys, values

    def _lr_unlogged(self, *, closing: bool = False) -> None:
        """Warns (once) that ``lr``, asked for, has no rows: no optimizer, and the loop never
        logged it. Said at the second recorded step's end or at ``close()``, so that a value
        logged after the first step (``rec.log("lr", v, step=s)``) counts."""
        if self._lr_logged or "lr" in self._checks.warned:
            return
        self._lr_checks += 1
        if self._lr_checks >= 2 or closing:
            self._checks.warn_once("lr", "lr is read from the optimizer: give the Recorder the optimizer "
                                   "(Recorder(model, optimizer=opt), or rec.attach_optimizer(opt)) or log it yourself "
                                   "with rec.log('lr', value); until then it has no rows")


@contextlib.contextmanager
def no_autocast(device: torch.device | None):
    """Autocast off for ``device`` inside (entered only where it is on: building a
    ``torch.autocast`` costs more than the check)."""
    if device is None or not torch.is_autocast_enabled(device.type):
        yield
        return
    with torch.autocast(device_type=device.type, enabled=False):
        yield

