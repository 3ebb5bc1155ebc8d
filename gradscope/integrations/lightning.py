"""A Lightning ``Callback`` that records into the gradscope table.

    from gradscope.integrations.lightning import GradscopeCallback
    callback = GradscopeCallback(quantities="default")
    trainer = lightning.Trainer(callbacks=[callback], ...)
    trainer.fit(module, loader)
    df = callback.recorder.frame()

The step opens at ``on_train_batch_start`` of the first micro-batch of an optimizer step and
closes at ``on_before_optimizer_step`` (after every backward, after Lightning unscales AMP
gradients, before clipping and ``optimizer.step()``). Step index = ``trainer.global_step``.
The recorder watches the LightningModule itself.

With ``GradscopeCallback(on_spike="replay", ...)`` every optimizer step is watched (its loss,
the sum of the micro-batches' losses as Lightning backpropagates them, and the total gradient
norm) at ``on_before_optimizer_step``; a spiking step the schedule skips is replayed: the
callback keeps references to the step's batches, and runs ``training_step`` and the
module's ``backward`` on each again (loss divided by ``accumulate_grad_batches``, scaled by
the precision plugin's GradScaler if it has one), with ``self.log`` muted, recorded
(:mod:`gradscope.recorder.replay.replay`). Other callbacks' backward hooks do not fire in the replay.
"""

from __future__ import annotations

import contextlib

from lightning.pytorch.callbacks import Callback

from gradscope.recorder import Recorder


class GradscopeCallback(Callback):
    """Records the quantities of docs/quantities.md during ``Trainer.fit``.

    Args:
        **recorder_kwargs: passed to :class:`gradscope.Recorder`; the recorder is
            ``self.recorder`` once fitting starts.
    """

    def __init__(self, **recorder_kwargs) -> None:
        self.recorder_kwargs = recorder_kwargs
        self.recorder: Recorder | None = None
        self._batches: list = []  # (batch, batch_idx) of the open step, kept only while watching
        self._loss = None
        self._logged = None  # Σ over the step's micro-batches of their loss / accumulate_grad_batches
        self._log_loss = False  # the step is recorded (or replayed): its loss gets a row
        self._micro = 0  # micro-batches of the step whose loss was added into _logged
        self._paused = None  # the recorder's pause while a validation loop runs inside an open step

    def on_fit_start(self, trainer, pl_module):
        if self.recorder is None:
            self.recorder = Recorder(pl_module, **self.recorder_kwargs)
        elif self.recorder.closed:
            raise RuntimeError("GradscopeCallback: this callback's recorder was closed when its fit ended; give each "
                               "Trainer.fit a new GradscopeCallback (the last fit's table stays in "
                               "callback.recorder.frame())")
        if trainer.optimizers:
            self.recorder.attach_optimizer(trainer.optimizers[0])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.recorder.open_step is None:
            self._log_loss = self.recorder.begin_step(trainer.global_step)
            self._batches, self._loss, self._logged, self._micro = [], None, None, 0
        if self.recorder.watch is not None:
            self._batches.append((batch, batch_idx))

    def on_validation_start(self, trainer, pl_module):
        """Validation inside an open step (``val_check_interval`` in the middle of gradient
        accumulation) is not recorded: its forwards would add to the step's ``act_norm``."""
        if self.recorder is not None and self.recorder.open_step is not None:
            self._paused = self.recorder.paused()
            self._paused.__enter__()

    def on_validation_end(self, trainer, pl_module):
        if self._paused is not None:
            paused, self._paused = self._paused, None
            paused.__exit__(None, None, None)

    def on_before_backward(self, trainer, pl_module, loss):
        if self.recorder.watch is not None and self.recorder.open_step is not None:
            self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        step = self.recorder.open_step
        if step is not None:
            self.recorder.end_step()
            if self.recorder.watch is not None and self._loss is not None:
                batches = self._batches
                reading = self.recorder.check_spike(step, self._loss, lambda: _rerun(trainer, pl_module, batches))
                self._log_loss = self._log_loss or reading.flagged  # (a flagged step the schedule skipped is replayed)
            self._batches, self._loss = [], None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        """The step's ``loss`` row: the mean of its micro-batches' losses. Lightning hands each
        micro-batch's loss over divided by ``accumulate_grad_batches`` (also in an epoch's
        last step, which may hold fewer), so the mean is their sum times
        ``accumulate_grad_batches`` over the micro-batches counted; it is logged once the
        step has closed (after the last micro-batch), for a recorded or replayed step only."""
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            self._logged = loss.detach() if self._logged is None else self._logged + loss.detach()
            self._micro += 1
        if self.recorder.open_step is None and self._logged is not None:
            if self._log_loss:
                mean = self._logged * (trainer.accumulate_grad_batches / self._micro)
                self.recorder.log("loss", mean, step=trainer.global_step - 1)
            self._logged, self._micro = None, 0

    def on_fit_end(self, trainer, pl_module):
        if self.recorder is not None:
            if self.recorder.open_step is not None:
                self.recorder.abort_step()
            self.recorder.close()


def _rerun(trainer, pl_module, batches: list) -> object:
    """The step's micro-batches again, as Lightning's automatic optimization runs them."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    total = None
    with _muted(pl_module):
        for batch, batch_idx in batches:
            out = trainer.strategy.training_step(batch, batch_idx)
            loss = (out["loss"] if isinstance(out, dict) else out) / trainer.accumulate_grad_batches
            loss = scaler.scale(loss) if scaler is not None else loss  # as on_before_backward saw it
            pl_module.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
    return total


@contextlib.contextmanager
def _muted(pl_module):
    """``self.log`` and ``self.log_dict`` do nothing inside (a replay logs no metrics twice)."""
    pl_module.log = pl_module.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict
