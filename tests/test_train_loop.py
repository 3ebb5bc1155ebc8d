"""The training loop, schedule, loss and checkpoints (gradscope.train.loop / .optim / .checkpoint)."""

from __future__ import annotations

import contextlib
import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradscope.table import COLUMNS
from gradscope.train import (
    TrainConfig,
    evaluate,
    evaluate_metrics,
    label_smoothed_loss,
    load_checkpoint,
    make_optimizer,
    make_scheduler,
    make_task,
    train,
)

VOCAB, MAX_LEN = 10, 8


# --- stand-in models with the zoo's calling convention -------------------------------

class _Embed(nn.Module):
    def __init__(self, vocab: int, max_len: int, d: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)

    def forward(self, x):
        return self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))  # (B, T, d)


class TinySeq2Seq(nn.Module):
    """``model(src, tgt_in) -> logits (B, T, vocab)``."""

    def __init__(self, vocab=VOCAB, max_len=MAX_LEN, d=32, dropout=0.1, pad_id=0):
        super().__init__()
        self.pad_id, self.embed = pad_id, _Embed(vocab, max_len, d)
        enc_layer = nn.TransformerEncoderLayer(d, 2, 64, dropout=dropout, batch_first=True)
        encoder = nn.TransformerEncoder(enc_layer, 1, norm=nn.LayerNorm(d), enable_nested_tensor=False)
        self.core = nn.Transformer(d, 2, 1, 1, dim_feedforward=64, dropout=dropout, batch_first=True,
                                   custom_encoder=encoder)
        self.out = nn.Linear(d, vocab)

    def forward(self, src, tgt_in):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
        src_pad = src == self.pad_id
        h = self.core(self.embed(src), self.embed(tgt_in), tgt_mask=causal, tgt_is_causal=True,
                      src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad)
        return self.out(h)


class TinyStack(nn.Module):
    """``model(tokens) -> logits``; causal for ``decoder``, bidirectional for ``encoder``."""

    def __init__(self, vocab=VOCAB, max_len=MAX_LEN, d=32, dropout=0.1, causal=True):
        super().__init__()
        self.causal, self.embed = causal, _Embed(vocab, max_len, d)
        self.layer = nn.TransformerEncoderLayer(d, 2, 64, dropout=dropout, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, tokens):
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1]) if self.causal else None
        return self.out(self.layer(self.embed(tokens), src_mask=mask, is_causal=self.causal))


def _reverse():
    return make_task("reverse", vocab=VOCAB, max_len=MAX_LEN, seed=0)


def _cfg(**kw):
    base = dict(steps=12, batch_size=8, lr=3e-3, warmup=4, eval_every=3, eval_batches=2, device="cpu")
    return TrainConfig(**{**base, **kw})


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return TinySeq2Seq(**kw)


# --- config, schedule, loss ---------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("steps", 0), ("batch_size", 0), ("lr", 0.0), ("warmup", -1), ("schedule", "cosine"), ("betas", (0.9, 1.0)),
    ("eps", 0.0), ("label_smoothing", 1.0), ("clip_norm", 0.0), ("eval_batches", 0), ("device", "tpu"),
])
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})


def test_config_is_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        TrainConfig(10)  # noqa
    with pytest.raises(AttributeError):
        TrainConfig().lr = 1.0


@pytest.mark.parametrize("warmup, schedule", [(5, "inverse_sqrt"), (0, "inverse_sqrt"), (5, "constant")])
def test_schedule_matches_formula(warmup, schedule):
    peak = 2e-3
    param = nn.Parameter(torch.zeros(1))
    cfg = TrainConfig(lr=peak, warmup=warmup, schedule=schedule)
    opt = make_optimizer(nn.ParameterList([param]), cfg)
    sched = make_scheduler(opt, cfg)
    for step in range(1, 40):
        w = max(warmup, 1)
        ramp = min(step / warmup, 1.0) if warmup else 1.0
        expected = peak * (ramp if schedule == "constant" else min(ramp, math.sqrt(w / step)))
        assert opt.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12), step
        opt.step()
        sched.step()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_matches_torch_cross_entropy(smoothing):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 7, VOCAB, generator=gen)
    target = torch.randint(3, VOCAB, (4, 7), generator=gen)
    target[:, 5:] = 0
    target[0, 2:] = 0
    ours = label_smoothed_loss(logits, target, pad_id=0, smoothing=smoothing)
    ref = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=0,
                          label_smoothing=smoothing, reduction="mean")
    torch.testing.assert_close(ours, ref)


# --- the loop -----------------------------------------------------------------------

def test_training_reduces_loss_on_reverse():
    result = train(_model(), _reverse(), _cfg(steps=200, batch_size=32, warmup=20, eval_every=100), progress=False)
    loss, val = result.curve("loss"), result.curve("val_loss")
    assert not result.diverged and result.step == 200
    assert loss.iloc[-20:].mean() < 0.6 * loss.iloc[:10].mean()
    assert list(val.index) == [100, 200] and val.iloc[-1] < loss.iloc[:10].mean()


@pytest.mark.parametrize("name, causal", [("markov_lm", True), ("markov_mlm", False)])
def test_decoder_and_encoder_tasks_train(name, causal):
    task = make_task(name, vocab=VOCAB, max_len=MAX_LEN, seed=0)
    torch.manual_seed(0)
    result = train(TinyStack(causal=causal), task, _cfg(steps=60, batch_size=32, warmup=10, eval_every=0),
                   progress=False)
    loss = result.curve("loss")
    assert loss.iloc[-10:].mean() < loss.iloc[:5].mean()


def test_history_is_a_tidy_table():
    result = train(_model(), _reverse(), _cfg(steps=7, lr=1e-3), progress=False, run="r1", variant="toy")
    h = result.history
    assert tuple(h.columns) == COLUMNS and set(h["run"]) == {"r1"} and set(h["variant"]) == {"toy"}
    assert h.groupby("quantity")["step"].apply(list).to_dict() == {
        "loss": list(range(1, 8)), "lr": list(range(1, 8)), "val_loss": [3, 6], "val_accuracy": [3, 6]}
    lr = result.curve("lr")
    assert [lr[s] for s in (1, 4, 7)] == pytest.approx([1e-3 / 4, 1e-3, 1e-3 * math.sqrt(4 / 7)])
    assert set(h.loc[h["quantity"] != "lr", "reduction"]) == {"mean"}
    assert result.loss_reduction == "mean" and result.loss_log_base == "e"
    assert h.attrs["loss_log_base"] == "e"


class FakeRecorder:
    """Logs the order of step entry/exit, logs, forward, backward and optimizer steps."""

    def __init__(self, model):
        self.events, self.model = [], model
        model.register_forward_hook(lambda *_: self.events.append(("forward",)) if self.in_step else None)
        self.in_step = False
        next(model.parameters()).register_hook(lambda g: self.events.append(("backward",)))

    @contextlib.contextmanager
    def step(self, step):
        self.in_step = True
        self.events.append(("enter", step))
        yield
        self.events.append(("exit", step))
        self.in_step = False

    def log(self, quantity, value, *, step):
        self.events.append(("log", step, quantity, value))


def test_recorder_protocol_call_order():
    model = _model()
    rec = FakeRecorder(model)
    handle = register_optimizer_step_pre_hook(lambda *_: rec.events.append(("optim",)))
    try:
        result = train(model, _reverse(), _cfg(steps=3, eval_every=2), recorder=rec, progress=False)
    finally:
        handle.remove()
    loss, lr = result.curve("loss"), result.curve("lr")
    for s in (1, 2, 3):
        expected = [("enter", s), ("forward",), ("backward",), ("exit", s),
                    ("log", s, "loss", loss[s]), ("log", s, "lr", lr[s]), ("optim",)]
        start = rec.events.index(("enter", s))
        assert rec.events[start : start + 7] == expected


class NaNAfter(nn.Module):
    """Wraps a model; training forwards after the ``after``-th return NaN logits."""

    def __init__(self, inner, after):
        super().__init__()
        self.inner, self.after, self.calls = inner, after, 0

    def forward(self, *args):
        out = self.inner(*args)
        if self.training:
            self.calls += 1
            if self.calls > self.after:
                return out * float("nan")
        return out


def test_nonfinite_loss_stops_and_is_recorded():
    model = NaNAfter(_model(), after=2)
    result = train(model, _reverse(), _cfg(steps=10), progress=False)
    loss = result.curve("loss")
    assert result.diverged and result.step == 3 and list(loss.index) == [1, 2, 3]
    assert math.isfinite(loss[2]) and math.isnan(loss[3])
    assert all(torch.isfinite(p).all() for p in model.parameters()), "the NaN step is not applied"

    result = train(NaNAfter(_model(), after=2), _reverse(), _cfg(steps=5, stop_on_nonfinite=False),
                   progress=False)
    assert result.diverged and result.step == 5 and result.curve("loss").iloc[2:].isna().all()


# --- checkpoints and resume ---------------------------------------------------------

def _assert_same(a_model, a, b_model, b):
    for (name, p), (_, q) in zip(a_model.state_dict().items(), b_model.state_dict().items()):
        assert torch.equal(p, q), name
    pd.testing.assert_frame_equal(a.history, b.history)


def test_resume_is_bit_identical(tmp_path):
    straight_model = _model(dropout=0.1)
    straight = train(straight_model, _reverse(), _cfg(steps=12, clip_norm=1.0), progress=False)

    model = _model(dropout=0.1)
    first = train(model, _reverse(), _cfg(steps=6, clip_norm=1.0), checkpoint_dir=tmp_path, progress=False)
    assert first.step == 6 and load_checkpoint(tmp_path)["step"] == 6
    torch.manual_seed(1234)  # disturb every RNG the run depends on; the checkpoint restores them
    resumed_model = _model(seed=99, dropout=0.1)
    resumed = train(resumed_model, _reverse(), _cfg(steps=12, clip_norm=1.0), checkpoint_dir=tmp_path,
                    progress=False)
    assert resumed.resumed_from == 6 and resumed.step == 12
    _assert_same(straight_model, straight, resumed_model, resumed)
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"], "no temporary files left behind"


class CrashAt:
    """A recorder whose step context raises at one step: simulates a killed run."""

    def __init__(self, at):
        self.at = at

    @contextlib.contextmanager
    def step(self, step):
        if step == self.at:
            raise KeyboardInterrupt
        yield


def test_resume_after_crash_between_checkpoints(tmp_path):
    straight_model = _model()
    straight = train(straight_model, _reverse(), _cfg(steps=10), progress=False)
    with pytest.raises(KeyboardInterrupt):
        train(_model(), _reverse(), _cfg(steps=10, checkpoint_every=4), checkpoint_dir=tmp_path,
              recorder=CrashAt(7), progress=False)
    assert load_checkpoint(tmp_path)["step"] == 4
    model = _model(seed=5)
    resumed = train(model, _reverse(), _cfg(steps=10, checkpoint_every=4), checkpoint_dir=tmp_path, progress=False)
    assert resumed.resumed_from == 4
    _assert_same(straight_model, straight, model, resumed)


def test_resume_refuses_a_different_recipe_and_can_be_disabled(tmp_path):
    train(_model(), _reverse(), _cfg(steps=2), checkpoint_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="lr"):
        train(_model(), _reverse(), _cfg(steps=4, lr=1e-2), checkpoint_dir=tmp_path, progress=False)
    fresh = train(_model(), _reverse(), _cfg(steps=4, lr=1e-2), checkpoint_dir=tmp_path, resume=False,
                  progress=False)
    assert fresh.resumed_from is None and load_checkpoint(tmp_path)["step"] == 4


def test_progress_bar_and_auto_device_do_not_break_a_run():
    result = train(_model(), _reverse(), _cfg(steps=2, device="auto", eval_every=0), progress=True)
    assert result.step == 2


def test_zoo_model_learns_reverse_when_available():
    import gradscope

    if not hasattr(gradscope, "build_model"):
        pytest.skip("gradscope.build_model not available yet")
    torch.manual_seed(0)
    model = gradscope.build_model(gradscope.ModelConfig(
        arch="encoder_decoder", variant="pre_ln", n_enc=2, n_dec=2, d_model=32, n_heads=2, d_ff=64, vocab=VOCAB,
        dropout=0.1, max_len=MAX_LEN, pad_id=0))
    result = train(model, _reverse(), _cfg(steps=150, batch_size=32, warmup=20, eval_every=0), progress=False)
    loss = result.curve("loss")
    assert not result.diverged and loss.iloc[-20:].mean() < 0.7 * loss.iloc[:10].mean()


class _AlwaysEos(torch.nn.Module):
    """Logits that put every position on EOS (argmax), whatever the input."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.bias = vocab, torch.nn.Parameter(torch.zeros(()))

    def forward(self, src, tgt_in):
        logits = torch.zeros(*tgt_in.shape, self.vocab) + self.bias
        logits[..., 2] = 5.0
        return logits


def test_evaluate_metrics_accuracy_is_the_share_of_tokens_predicted():
    task = _reverse()
    loss, accuracy = evaluate_metrics(_AlwaysEos(task.vocab), task, batch_size=8, n_batches=3)
    targets = torch.cat([task.targets(task.batch("valid", i, 8)).flatten() for i in range(3)])
    targets = targets[targets != task.pad_id]
    assert accuracy == pytest.approx(float((targets == 2).double().mean()), abs=1e-12)
    assert 0 < accuracy < 0.5 and loss == evaluate(_AlwaysEos(task.vocab), task, batch_size=8, n_batches=3)
