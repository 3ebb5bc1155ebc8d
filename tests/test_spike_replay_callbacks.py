"""Issue 26, spike replay in the callbacks: the Lightning callback (with gradient
accumulation) and the plain training loop. References are computed here: a Lightning run
recording every step, and runs without any recorder (``torch.equal``)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import gradscope
from gradscope.recorder.replay.replay import ReplayOptions
from test_spike_replay import assert_same_rows, step_rows

SPIKE_AT = 6
OPTIONS = ReplayOptions(window=8, min_history=4)


def _fit(callback, accumulate: int = 2):
    lightning = pytest.importorskip("lightning")

    class LitLM(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = gradscope.build_model(gradscope.presets.tiny(variant="pre_ln", arch="decoder", n_dec=2,
                                                                      vocab=40, d_model=16, d_ff=32, dropout=0.1))

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            loss = F.cross_entropy(self.model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            self.log("train_loss", loss)
            return loss * 1e3 if self.trainer.global_step == SPIKE_AT else loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    module = LitLM()
    tokens = torch.randint(3, 40, (64, 9), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)
    trainer = lightning.Trainer(max_steps=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulate,
                                callbacks=[callback] if callback is not None else [])
    trainer.fit(module, loader)
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_lightning_replays_a_spike_like_a_run_recording_every_step():
    from gradscope.integrations.lightning import GradscopeCallback

    watched = GradscopeCallback(quantities="default", every=1000, on_spike=OPTIONS)
    params = _fit(watched)
    always = GradscopeCallback(quantities="default", every=1, on_spike=OPTIONS)
    _fit(always)
    plain = _fit(None)
    assert [r.step for r in watched.recorder.watch.flagged] == [SPIKE_AT]
    df = watched.recorder.frame(micro_steps=True)
    assert set(df[df.quantity != "loss"].step) == {0, SPIKE_AT}  # step 0 by the schedule (every=1000)
    assert df[df.quantity == "replay"].value.iloc[0] > 6
    rows = step_rows(df[df.quantity != "loss"], SPIKE_AT)
    assert set(rows.index.get_level_values("micro_step")) == {-1, 0, 1}  # two micro-batches replayed
    ref = always.recorder.frame(micro_steps=True)
    assert_same_rows(rows, step_rows(ref[ref.quantity != "loss"], SPIKE_AT))
    for name in plain:
        assert torch.equal(params[name], plain[name]), name


def test_the_training_loop_watches_every_step_and_changes_nothing():
    from gradscope.train import TrainConfig, make_task, train

    task = make_task("reverse", vocab=32, max_len=10)
    config = TrainConfig(steps=12, batch_size=8, lr=1e-3, warmup=2, eval_every=0, device="cpu", clip_norm=1.0)
    cfg = gradscope.presets.tiny(variant="pre_ln", n_enc=1, n_dec=1, vocab=32, max_len=10, dropout=0.1)
    params = []
    for watched in (True, False):
        torch.manual_seed(0)
        model = gradscope.build_model(cfg)
        rec = gradscope.Recorder(model, every=5, on_spike=OPTIONS) if watched else None
        result = train(model, task, config, recorder=rec, progress=False)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if watched:
            assert rec.watch.last.step == 12 and rec.watch.flagged == []
            table = result.store.frame()
            assert sorted(table[table.quantity == "act_grad_norm"].step.unique()) == [5, 10]
            assert isinstance(table, pd.DataFrame) and (table[table.quantity == "loss"].groupby("step").size() == 1).all()
            rec.close()
    for name in params[1]:
        assert torch.equal(params[0][name], params[1][name]), name
