"""A Weights & Biases sink: each recorded step logged to the active run, one series per site.

    wandb.init(project="deep-postln")
    rec = gradscope.Recorder(model, sinks=[WandbSink()])

Series are named :func:`gradscope.sinks.base.series_name` (``act_grad_norm/decoder.layers.3.out``),
so the W&B workspace groups them into one panel section per quantity. Every logged dict
also holds ``gradscope/step`` (the recorder's step), and the sink declares it the x-axis of
every gradscope series (``define_metric(<quantity>/*, step_metric="gradscope/step")``).

Steps: the sink never passes ``step=`` to ``wandb.log``; rows land at the tracker's own
step. Two choices (``commit``):

- ``commit=True`` (default): each recorded step is one ``wandb.log`` call of its own,
  which advances the tracker's step by one. Nothing is ever overwritten, whatever the loop
  logs and however rarely (HF's and Lightning's W&B loggers log every N steps and plot
  against their own ``train/global_step`` / ``trainer/global_step``, so they are unaffected).
  A loop that passes ``step=`` to its own ``wandb.log`` should use ``commit=False``.
- ``commit=False``: the step's values join the tracker's current, uncommitted row, which
  the loop's next ``wandb.log`` commits; for a loop that logs to W&B once per step.

A step's rows are logged when the next recorded step begins (or at ``flush``/``close``),
because ``update_ratio`` and scalars logged with ``step=`` arrive after the step closes.
"""

from __future__ import annotations

import numpy as np

from gradscope.sinks.base import NameCache, RunInfo, Sink
from gradscope.table.keys import Key

STEP_KEY = "gradscope/step"


class WandbSink(Sink):
    """Logs each recorded step to a W&B run.

    Args:
        run: a ``wandb`` run (default: ``wandb.run``, the active one, looked up when the
            Recorder is made and again at the first log if there was none then). With
            Lightning pass ``run=wandb_logger.experiment``, which starts the logger's run.
        commit: whether each step is its own ``wandb.log`` commit (default True); see the
            module docstring.
    """

    def __init__(self, run=None, *, commit: bool = True) -> None:
        self.run, self.commit = run, commit
        self._names = NameCache()
        self._step: int | None = None
        self._row: dict[str, float] = {}
        self._declared: set[str] = set()
        self._closed = False

    def open(self, info: RunInfo) -> None:
        super().open(info)
        self._active()

    def _active(self):
        """The run to log to (the active one if none was given), or None."""
        if self.run is None:
            import wandb

            self.run = wandb.run
            if self.run is not None:
                self.run.define_metric(STEP_KEY)
        return self.run

    def begin(self, step: int) -> None:
        if self._step is not None and self._step != step:
            self.flush()

    def append(self, step: int, keys: list[Key], values: np.ndarray) -> None:
        if self._closed:
            raise RuntimeError("WandbSink: closed")
        if self._step is not None and step != self._step:
            self.flush()
        self._step = step
        names = self._names(keys, self.info.rank if self.info else 0)
        self._row.update(zip(names, np.asarray(values, float).tolist()))

    def flush(self) -> None:
        if self._step is None:
            return
        if self._active() is None:
            raise RuntimeError("WandbSink: no active W&B run; call wandb.init(...) before training, or pass run=")
        for quantity in {name.split("/", 1)[0] for name in self._row} - self._declared:
            self.run.define_metric(f"{quantity}/*", step_metric=STEP_KEY)
            self._declared.add(quantity)
        self.run.log({**self._row, STEP_KEY: self._step}, commit=self.commit)
        self._step, self._row = None, {}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.flush()
