"""A HuggingFace ``TrainerCallback`` that records into the gradscope table.

    from gradscope.integrations.hf import GradscopeCallback
    callback = GradscopeCallback(quantities="default")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
    trainer.train()
    df = callback.recorder.frame()

The step opens at ``on_step_begin`` (before the first micro-batch of a step) and closes at
``on_pre_optimizer_step`` (after every backward, before ``optimizer.step()``), so gradient
accumulation is covered. Step index = ``state.global_step`` before the update. The Trainer
clips gradients *before* ``on_pre_optimizer_step``: with ``max_grad_norm > 0`` the
``param_grad_norm`` rows are the clipped norms (activation gradients are unaffected). Set
``max_grad_norm=0`` to record unclipped parameter norms.
"""

from __future__ import annotations

from transformers import TrainerCallback

from gradscope.recorder import Recorder


class GradscopeCallback(TrainerCallback):
    """Records SPEC §3 quantities during ``Trainer.train()``.

    Args:
        **recorder_kwargs: passed to :class:`gradscope.Recorder` (``quantities``, ``every``,
            ``sites``, ``run``...). The recorder is built on the first step, on the
            Trainer's model, and available as ``self.recorder``.
    """

    def __init__(self, **recorder_kwargs) -> None:
        self.recorder_kwargs = recorder_kwargs
        self.recorder: Recorder | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.recorder is None:
            self.recorder = Recorder(model, **self.recorder_kwargs)
        if optimizer is not None:
            self.recorder.attach_optimizer(optimizer)

    def on_step_begin(self, args, state, control, **kwargs):
        self.recorder.begin_step(state.global_step)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.recorder.open_step is not None:
            self.recorder.end_step()

    def on_log(self, args, state, control, logs=None, **kwargs):
        # on_log runs after the update, when global_step already counts it
        for name in ("loss", "learning_rate"):
            if logs and name in logs:
                self.recorder.log("lr" if name == "learning_rate" else "loss", logs[name], step=state.global_step - 1)

    def on_train_end(self, args, state, control, **kwargs):
        if self.recorder is not None:
            if self.recorder.open_step is not None:
                self.recorder.abort_step()
            self.recorder.close()
