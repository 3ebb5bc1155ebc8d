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
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from gradscope.recorder import Recorder


class GradscopeCallback(Callback):
    """Records SPEC §3 quantities during ``Trainer.fit``.

    Args:
        **recorder_kwargs: passed to :class:`gradscope.Recorder`; the recorder is
            ``self.recorder`` once fitting starts.
    """

    def __init__(self, **recorder_kwargs) -> None:
        self.recorder_kwargs = recorder_kwargs
        self.recorder: Recorder | None = None

    def on_fit_start(self, trainer, pl_module):
        if self.recorder is None:
            self.recorder = Recorder(pl_module, **self.recorder_kwargs)
        if trainer.optimizers:
            self.recorder.attach_optimizer(trainer.optimizers[0])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.recorder.open_step is None:
            self.recorder.begin_step(trainer.global_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.recorder.open_step is not None:
            self.recorder.end_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None and self.recorder.open_step is None:
            self.recorder.log("loss", loss.detach(), step=trainer.global_step - 1)

    def on_fit_end(self, trainer, pl_module):
        if self.recorder is not None:
            if self.recorder.open_step is not None:
                self.recorder.abort_step()
            self.recorder.close()
