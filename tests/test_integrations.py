"""HF Trainer and Lightning callbacks record what a plain Recorder records on the same
steps; TensorBoard output reads back."""

from __future__ import annotations

import copy
import warnings

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import gradscope

COMPARED = ["act_grad_norm", "param_grad_norm", "ln_gain"]


def compare(table: pd.DataFrame, reference: pd.DataFrame, step: int) -> int:
    a = table[(table.step == step) & table.quantity.isin(COMPARED)].set_index(["quantity", "site", "micro_step"]).value.sort_index()
    b = reference[reference.quantity.isin(COMPARED)].set_index(["quantity", "site", "micro_step"]).value.sort_index()
    assert list(a.index) == list(b.index)
    pd.testing.assert_series_equal(a, b, rtol=1e-5, check_names=False)
    return len(a)


def _gpt2_and_data(transformers, *, layers: int, width: int, sequences: int):
    """(config, a GPT-2 with dropout off, a list of {input_ids, labels} of 8 tokens), seeded."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=2, vocab_size=50, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(1, 50, (sequences, 8), generator=g)]
    return config, transformers.GPT2LMHeadModel(config), data


def test_hf_trainer_callback_matches_plain_recorder(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from gradscope.integrations.hf import GradscopeCallback

    config, model, data = _gpt2_and_data(transformers, layers=2, width=32, sequences=12)
    seen: dict[int, tuple] = {}

    class Snapshot(transformers.TrainerCallback):  # the weights and inputs each step started from
        def on_step_begin(self, args, state, control, model=None, **kw):
            seen[state.global_step] = (copy.deepcopy(model.state_dict()), [])

    model.register_forward_pre_hook(lambda m, a, kw: seen[max(seen)][1].append(dict(kw)) if seen else None, with_kwargs=True)
    callback = GradscopeCallback(quantities="default", run="hf")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3,
                                          learning_rate=1e-3, max_grad_norm=0.0, report_to=[], use_cpu=True,
                                          logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[Snapshot(), callback])
    trainer.train()
    table = callback.recorder.frame()
    assert sorted(table.step.unique()) == [1, 2, 3]  # the Trainer's numbering (issue 52): its logs say steps 1, 2, 3
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3]
    for before, (state, calls) in seen.items():  # (global_step before the update: the Trainer calls the update before + 1)
        step = before + 1
        replay = transformers.GPT2LMHeadModel(config)
        replay.load_state_dict(state)
        replay.train()
        with gradscope.record(replay, quantities="default") as rec:
            for kw in calls:
                replay(**kw).loss.backward()
        assert compare(table, rec.frame(), step) > 20


def _lit_lm(lightning, losses: list[float] | None = None):
    """A LightningModule around a tiny zoo decoder (``losses``: where each micro-batch's loss goes)."""

    class LitLM(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = gradscope.build_model(gradscope.presets.tiny(variant="pre_ln", arch="decoder", vocab=40))

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            loss = F.cross_entropy(self.model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            if losses is not None:
                losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return LitLM


def test_lightning_callback_matches_plain_recorder():
    lightning = pytest.importorskip("lightning")
    from gradscope.integrations.lightning import GradscopeCallback

    torch.manual_seed(0)
    module = _lit_lm(lightning)()
    tokens = torch.randint(3, 40, (16, 9), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)
    seen: dict[int, tuple] = {}

    class Snapshot(lightning.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen[trainer.global_step] = (copy.deepcopy(pl_module.model.state_dict()), batch[0].clone())

    callback = GradscopeCallback(quantities="default")
    trainer = lightning.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[Snapshot(), callback])
    trainer.fit(module, loader)
    table = callback.recorder.frame()
    assert sorted(table.step.unique()) == [0, 1, 2]
    assert "decoder.layers.0.self_attn.norm.in" in set(table.site)  # canonical zoo names inside the LightningModule
    for step, (state, batch) in seen.items():
        replay = gradscope.build_model(module.model.config)
        replay.load_state_dict(state)
        with gradscope.record(replay, quantities="default") as rec:
            F.cross_entropy(replay(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
        assert compare(table, rec.frame(), step) > 20
    losses = table[table.quantity == "loss"]
    assert sorted(losses.step) == [0, 1, 2]


def test_tensorboard_scalars_read_back(tmp_path):
    tbparse = pytest.importorskip("tbparse")
    from gradscope.integrations.tensorboard import to_tensorboard

    model = gradscope.build_model(gradscope.presets.tiny(variant="post_ln", arch="decoder", vocab=40))
    rec = gradscope.Recorder(model)
    for step in range(2):
        with rec.step(step):
            tokens = torch.randint(3, 40, (2, 6))
            loss = model(tokens).logsumexp(-1).mean()
            loss.backward()
            rec.log("loss", loss)
    frame = rec.frame()
    written = to_tensorboard(frame, tmp_path / "tb")
    scalars = tbparse.SummaryReader(str(tmp_path / "tb")).scalars
    assert written == len(frame) == len(scalars)
    row = frame[(frame.step == 1) & (frame.quantity == "act_grad_norm") & (frame.site == "decoder.layers.1.out")].iloc[0]
    got = scalars[(scalars.tag == "act_grad_norm/decoder.layers.1.out") & (scalars.step == 1)].value.item()
    assert got == pytest.approx(row.value, rel=1e-6)
    assert set(scalars[scalars.tag == "loss/total"].step) == {0, 1}
    # a folder of runs loaded at once: one TensorBoard run each, not one series with two values per step
    two = pd.concat([frame, frame.assign(run="other", value=frame.value * 2)], ignore_index=True)
    assert to_tensorboard(two, tmp_path / "tb2") == 2 * len(frame)
    runs = tbparse.SummaryReader(str(tmp_path / "tb2"), extra_columns={"dir_name"}).scalars
    assert runs.groupby(["dir_name", "tag", "step"]).size().max() == 1 and len(runs) == 2 * len(frame)
    other = runs[(runs.dir_name == "other") & (runs.tag == "act_grad_norm/decoder.layers.1.out") & (runs.step == 1)]
    assert other.value.item() == pytest.approx(2 * row.value, rel=1e-6)


def test_lightning_loss_row_is_the_mean_over_micro_batches_of_recorded_steps_only():
    lightning = pytest.importorskip("lightning")
    from gradscope.integrations.lightning import GradscopeCallback

    losses: list[float] = []
    torch.manual_seed(0)
    tokens = torch.randint(3, 40, (24, 9), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)
    callback = GradscopeCallback(quantities="default", every=2)
    trainer = lightning.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                                accumulate_grad_batches=2)
    trainer.fit(_lit_lm(lightning, losses)(), loader)
    rows = callback.recorder.frame().query("quantity == 'loss'")
    assert sorted(rows.step) == [0, 2], "a loss row for a step the schedule did not record"
    for step, value in zip(rows.step, rows.value):
        assert value == pytest.approx((losses[2 * step] + losses[2 * step + 1]) / 2, rel=1e-6), step


@pytest.mark.parametrize("logging_steps", [1, 2])
def test_hf_loss_rows_are_the_step_s_own_loss_or_none(tmp_path, logging_steps):
    """The Trainer's logged loss is a mean over logging_steps steps: it is a recorded step's
    row only when it covers that step alone; lr is the optimizer's in every recorded step."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from gradscope.integrations.hf import GradscopeCallback

    _, model, data = _gpt2_and_data(transformers, layers=1, width=16, sequences=16)
    losses: list[float] = []
    lrs: list[float] = []

    class Own(transformers.TrainerCallback):  # each step's loss, as the model returns it, and lr
        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
            lrs.append(optimizer.param_groups[0]["lr"])

    model.register_forward_hook(lambda m, a, out: losses.append(out.loss.item()))
    callback = GradscopeCallback(quantities="default", every=2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4,
                                          learning_rate=1e-3, report_to=[], use_cpu=True, logging_steps=logging_steps,
                                          save_strategy="no", seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[Own(), callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    table = callback.recorder.frame()
    loss = table.query("quantity == 'loss'").set_index("step").value
    lr = table.query("quantity == 'lr'").set_index("step").value
    # the table's step is the Trainer's (state.global_step after the update, as its logs): every=2 records 2 and 4,
    # the 2nd and 4th updates (lrs[1], lrs[3])
    assert sorted(lr.index) == [2, 4] and all(lr[s] == pytest.approx(lrs[s - 1], rel=1e-6) for s in (2, 4))
    if logging_steps == 1:
        assert sorted(loss.index) == [2, 4]
        logged = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        for step in (2, 4):
            assert loss[step] == logged[step], step  # the Trainer's own log of that step, under the same step
            assert loss[step] == pytest.approx(losses[step - 1], rel=1e-4), step  # (the Trainer logs 4 digits)
    else:
        assert loss.empty
        assert any("logging_steps=2" in str(w.message) for w in caught)


def _fit(lightning, callback, *, batches: int, accumulate: int, validate: bool = False, max_steps: int = -1, losses=None):
    """Fits a seeded tiny LitLM on ``batches`` batches of 4 for one epoch (validating after
    every batch when ``validate``); returns the module."""
    torch.manual_seed(0)
    base = _lit_lm(lightning, losses)

    class WithValidation(base):
        def validation_step(self, batch, batch_idx):
            (tokens,) = batch
            return F.cross_entropy(self.model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    module = WithValidation()
    tokens = torch.randint(3, 40, (4 * batches, 9), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:4]), batch_size=4)
    trainer = lightning.Trainer(max_epochs=1, max_steps=max_steps, accelerator="cpu", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                callbacks=[callback], accumulate_grad_batches=accumulate,
                                limit_val_batches=1 if validate else 0, val_check_interval=1 if validate else None,
                                num_sanity_val_steps=0)
    trainer.fit(module, loader, val if validate else None)
    return trainer


def test_lightning_loss_of_an_epoch_s_short_last_step_is_its_mean():
    """5 batches with accumulate_grad_batches=2: the last step has one micro-batch, whose
    loss Lightning still divides by 2 (the row was half the loss)."""
    lightning = pytest.importorskip("lightning")
    from gradscope.integrations.lightning import GradscopeCallback

    losses: list[float] = []
    callback = GradscopeCallback(quantities="default")
    _fit(lightning, callback, batches=5, accumulate=2, losses=losses)
    rows = callback.recorder.frame().query("quantity == 'loss'").sort_values("step")
    assert rows.value.tolist() == pytest.approx([(losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2, losses[4]],
                                                rel=1e-6)


def test_lightning_validation_inside_an_accumulation_step_is_not_recorded():
    """val_check_interval=1 with accumulate_grad_batches=2 runs validation between a step's
    micro-batches: its forward added to the step's act_norm (+20-40 %)."""
    lightning = pytest.importorskip("lightning")
    from gradscope.integrations.lightning import GradscopeCallback

    tables = []
    for validate in (False, True):
        callback = GradscopeCallback(quantities="default")
        _fit(lightning, callback, batches=4, accumulate=2, validate=validate, max_steps=2)
        tables.append(callback.recorder.frame())
    key = ["step", "micro_step", "site", "quantity"]
    plain, validated = (t.sort_values(key).reset_index(drop=True) for t in tables)
    assert len(plain) == len(validated) and "act_norm" in set(plain.quantity)
    pd.testing.assert_frame_equal(plain[key + ["value"]], validated[key + ["value"]])
    with pytest.raises(RuntimeError, match="give each Trainer.fit a new GradscopeCallback"):
        _fit(lightning, callback, batches=2, accumulate=1)  # (a second fit with a closed callback)
