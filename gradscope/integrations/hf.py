"""A HuggingFace ``TrainerCallback`` that records into the gradscope table.

    from gradscope.integrations.hf import GradscopeCallback
    callback = GradscopeCallback(quantities="default")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
    trainer.train()
    df = callback.recorder.frame()

The step opens at ``on_step_begin`` (before the first micro-batch of a step) and closes at
``on_pre_optimizer_step`` (after every backward, before ``optimizer.step()``), so gradient
accumulation is covered. The table's step is the Trainer's own: ``state.global_step`` after
the update, the ``step`` of ``trainer.state.log_history`` and of ``checkpoint-<step>``, so
the update the Trainer logs as step 1 (its first) is the table's step 1. With ``every=N`` the
recorded steps are N, 2N... (as ``logging_steps=N`` logs them). The Trainer
clips gradients *before* ``on_pre_optimizer_step``: with ``max_grad_norm > 0`` the
``param_grad_norm`` rows are the clipped norms (activation gradients are unaffected). Set
``max_grad_norm=0`` to record unclipped parameter norms.

``lr`` is read from the optimizer in each recorded step. ``loss`` comes from the Trainer's
logs, which average it over ``logging_steps`` steps and, in distributed training, over the
ranks: a recorded step gets a ``loss`` row only when a log covers that one step
(``logging_steps=1``) and one process; otherwise the callback says once why there is none
(log a per-rank loss yourself with ``callback.recorder.log`` inside the step).
"""

from __future__ import annotations

import warnings

from transformers import TrainerCallback

from gradscope.recorder import Recorder


class GradscopeCallback(TrainerCallback):
    """Records the quantities of docs/quantities.md during ``Trainer.train()``.

    Args:
        **recorder_kwargs: passed to :class:`gradscope.Recorder` (``quantities``, ``every``,
            ``sites``, ``run``...). The recorder is built on the first step, on the
            Trainer's model, and available as ``self.recorder``.
    """

    def __init__(self, **recorder_kwargs) -> None:
        self.recorder_kwargs = recorder_kwargs
        self.recorder: Recorder | None = None
        self._recorded: set[int] = set()  # recorded steps whose loss may still come in a log
        self._logged_at = 0  # global_step of the Trainer's last log
        self._said = False

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.recorder is None:
            self.recorder = Recorder(model, **self.recorder_kwargs)
        if optimizer is not None:
            self.recorder.attach_optimizer(optimizer)

    def on_step_begin(self, args, state, control, **kwargs):
        step = state.global_step + 1  # (the Trainer counts this update once it is done: its logs say step + 1)
        if self.recorder.begin_step(step):
            self._recorded.add(step)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self.recorder.open_step is not None:
            if optimizer is not None and state.global_step + 1 in self._recorded:
                self.recorder.log("lr", float(optimizer.param_groups[0]["lr"]))  # the lr of this update
            self.recorder.end_step()

    def on_log(self, args, state, control, logs=None, **kwargs):
        # on_log runs after the update, when global_step already counts it (the table's numbering)
        if not logs or "loss" not in logs:
            return
        first, last = self._logged_at + 1, state.global_step  # the steps this log's mean covers
        self._logged_at = state.global_step
        covered = {s for s in self._recorded if first <= s <= last}
        self._recorded -= covered
        if not covered:
            return
        if args.world_size > 1:
            self._no_loss("the Trainer logs the loss averaged over the ranks, and gradscope's loss rows are per "
                          "rank: no loss rows (log each rank's own with callback.recorder.log inside the step)")
        elif last > first:
            self._no_loss(f"the Trainer logs the loss averaged over logging_steps={args.logging_steps} steps: no "
                          "loss row for a recorded step unless a log covers that step alone (logging_steps=1)")
        else:
            self.recorder.log("loss", logs["loss"], step=last)

    def _no_loss(self, why: str) -> None:
        if not self._said:
            self._said = True
            warnings.warn(f"gradscope: {why}", stacklevel=3)

    def on_train_end(self, args, state, control, **kwargs):
        if self.recorder is not None:
            if self.recorder.open_step is not None:
                self.recorder.abort_step()
            self.recorder.close()
