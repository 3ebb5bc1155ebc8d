"""Issue 26, spike replay: ``Recorder(on_spike="replay")`` with ``rec.run(step, closure)``.

References are computed here: the replayed rows of a spiking step against a run of the same
seed, weights and batches that records every step; training with the watch against training
without any recorder (``torch.equal``)."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import gradscope
from gradscope.recorder.replay.replay import ReplayOptions

SPIKE_AT = 20
STEPS = 24
KEY = ["micro_step", "stack", "layer", "site", "quantity", "layer_j", "role"]


def zoo(dropout: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(0)
    return gradscope.build_model(gradscope.presets.tiny(variant="pre_ln", arch="decoder", n_dec=2, vocab=40,
                                                        d_model=16, d_ff=32, dropout=dropout))


def gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2)  # dropout 0.1
    return transformers.GPT2LMHeadModel(config)


def batches(n: int = STEPS, micro: int = 1, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(3, 40, (4, 9), generator=g) for _ in range(micro)] for _ in range(n)]


def closure_for(model: torch.nn.Module, micro_batches: list[torch.Tensor], spike: bool):
    """Forward and backward of one step over its micro-batches (loss ×1e3 on the spiking step)."""
    def step() -> torch.Tensor:
        total = 0.0
        for tokens in micro_batches:
            out = model(tokens[:, :-1])
            logits = out.logits if hasattr(out, "logits") else out
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) / len(micro_batches)
            loss = loss * 1e3 if spike else loss
            loss.backward()
            total = total + loss.detach()
        return total
    return step


def train(model, data, *, mode: str, spike_at: int | None = SPIKE_AT, quantities="default", **kwargs):
    """Adam over ``data``; mode ``plain`` (no recorder), ``watched`` (every=1000, on_spike) or
    ``always`` (every step recorded, slow quantities too). Returns (recorder or None, params)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = None
    if mode == "watched":
        rec = gradscope.Recorder(model, optimizer=opt, quantities=quantities, every=1000,
                                 on_spike=kwargs.pop("on_spike", "replay"), **kwargs)
    elif mode == "always":
        rec = gradscope.Recorder(model, optimizer=opt, quantities=quantities, every=1, slow_every=1, **kwargs)
    torch.manual_seed(1)  # dropout
    for step, micro in enumerate(data, start=1):
        closure = closure_for(model, micro, spike=step == spike_at)
        if rec is None:
            closure()
        else:
            rec.run(step, closure)
        opt.step()
        opt.zero_grad()
    if rec is not None:
        rec.close()
    return rec, {n: p.detach().clone() for n, p in model.named_parameters()}


def step_rows(df: pd.DataFrame, step: int) -> pd.Series:
    rows = df[(df.step == step) & ~df.quantity.isin(["replay", "replay_mismatch"])]
    return rows.set_index(KEY).value.sort_index()


def assert_same_rows(replayed: pd.Series, reference: pd.Series, rel: float = 1e-6) -> None:
    assert set(replayed.index) == set(reference.index), (set(replayed.index) ^ set(reference.index))
    a, b = replayed.to_numpy(), reference[replayed.index].to_numpy()
    both_nan = np.isnan(a) & np.isnan(b)
    worst = np.max(np.where(both_nan, 0.0, np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))
    assert worst <= rel, worst


@pytest.mark.parametrize("case", ["dropout", "accumulation", "gpt2"])
def test_replayed_rows_equal_a_run_recording_every_step(case):
    build, micro = {"dropout": (zoo, 1), "accumulation": (zoo, 2), "gpt2": (gpt2, 1)}[case]
    model = build()
    twin = copy.deepcopy(model)
    data = batches(micro=micro)
    watched, _ = train(model, data, mode="watched", quantities="all")
    always, _ = train(twin, data, mode="always", quantities="all")
    assert [r.step for r in watched.watch.flagged] == [SPIKE_AT]
    df, ref = watched.frame(micro_steps=True), always.frame(micro_steps=True)
    assert sorted(df.step.unique()) == [SPIKE_AT]  # the schedule (every=1000) records nothing else
    replay = df[df.quantity == "replay"]
    assert len(replay) == 1 and replay.site.iloc[0] == "" and replay.value.iloc[0] > 6
    assert replay.value.iloc[0] == pytest.approx(watched.watch.flagged[0].z)
    assert "replay_mismatch" not in set(df.quantity)
    rows = step_rows(df, SPIKE_AT)
    assert {"act_grad_norm", "param_grad_norm", "ln_gain", "loss", "update_ratio"} <= set(rows.index.get_level_values("quantity"))
    if micro == 2:
        assert set(rows.index.get_level_values("micro_step")) == {-1, 0, 1}
    assert len(rows) > 50
    assert_same_rows(rows, step_rows(ref, SPIKE_AT))


@pytest.mark.parametrize("spike_at", [SPIKE_AT, None])
def test_training_with_the_watch_is_bit_identical(spike_at):
    model = zoo()
    twin = copy.deepcopy(model)
    data = batches()
    rec, watched = train(model, data, mode="watched", spike_at=spike_at)
    _, plain = train(twin, data, mode="plain", spike_at=spike_at)
    assert [r.step for r in rec.watch.flagged] == ([] if spike_at is None else [spike_at])
    for name in plain:
        assert torch.equal(watched[name], plain[name]), name


def test_no_replay_on_a_smooth_run():
    rec, _ = train(zoo(), batches(n=40), mode="watched", spike_at=None)
    assert rec.watch.flagged == []
    assert rec.watch.last.step == 40 and rec.watch.last.loss > 0
    assert rec.frame().empty


def test_the_original_gradients_and_buffers_are_left_as_they_were():
    model = zoo(dropout=0.0)
    model.register_buffer("seen", torch.zeros(()))
    data = batches()
    rec = gradscope.Recorder(model, every=1000, on_spike=ReplayOptions(window=16, min_history=8))
    for step, micro in enumerate(data[:SPIKE_AT], start=1):
        model.zero_grad()
        inner = closure_for(model, micro, spike=step == SPIKE_AT)

        def closure():
            model.seen += 1  # a buffer the step updates, as BatchNorm's running stats
            return inner()
        rec.run(step, closure)
    grads = {n: p.grad for n, p in model.named_parameters()}
    expected = {n: g.clone() for n, g in grads.items()}
    assert model.seen.item() == SPIKE_AT  # not twice at the replayed step
    assert [r.step for r in rec.watch.flagged] == [SPIKE_AT]
    rec.close()
    # the same tensors, with the original backward's values (a fresh, independent backward)
    for n, p in model.named_parameters():
        assert p.grad is grads[n]
    twin = copy.deepcopy(model)
    twin.zero_grad(set_to_none=True)
    closure_for(twin, data[SPIKE_AT - 1], spike=True)()
    for n, p in twin.named_parameters():
        assert torch.equal(p.grad, expected[n]), n


def test_parameters_put_in_place_after_the_recorder_are_the_ones_watched_and_replayed():
    """``load_state_dict(assign=True)`` (as ``fully_shard``) gives the model new parameter
    objects after the Recorder was made: the watch norms their gradients, and the replay
    clears and gives back theirs (a list kept from construction gave a norm of 0, and a
    replay that left the gradients doubled)."""
    model = zoo(dropout=0.0)
    rec = gradscope.Recorder(model, every=1000, on_spike=ReplayOptions(window=16, min_history=8))
    model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)
    data = batches()
    for step, micro in enumerate(data[:SPIKE_AT], start=1):
        model.zero_grad(set_to_none=True)
        rec.run(step, closure_for(model, micro, spike=step == SPIKE_AT))
        live = [p.grad for p in model.parameters()]
        assert torch.equal(rec.grad_norm, torch.nn.utils.get_total_norm(live)), step
    assert [r.step for r in rec.watch.flagged] == [SPIKE_AT]
    rec.close()
    twin = copy.deepcopy(model)
    twin.zero_grad(set_to_none=True)
    closure_for(twin, data[SPIKE_AT - 1], spike=True)()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_a_replay_that_differs_warns_and_says_so_in_a_row():
    model = zoo(dropout=0.0)
    noise = torch.Generator().manual_seed(5)  # not a global generator: the replay draws other numbers
    rec = gradscope.Recorder(model, every=1000, on_spike="replay")
    data = batches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, micro in enumerate(data, start=1):
            model.zero_grad()
            inner = closure_for(model, micro, spike=step == SPIKE_AT)
            rec.run(step, lambda inner=inner: inner() * (1 + torch.rand((), generator=noise) * 1e-3))
    assert any("replay of step 20 differs" in str(w.message) for w in caught)
    df = rec.frame()
    mismatch = df[df.quantity == "replay_mismatch"]
    assert len(mismatch) == 1 and mismatch.step.iloc[0] == SPIKE_AT and 0 < mismatch.value.iloc[0] < 1e-2
    assert "act_grad_norm" in set(df.quantity)  # rows kept


def test_the_watch_norm_is_clip_grad_norms():
    model = zoo(dropout=0.0)
    twin = copy.deepcopy(model)
    rec = gradscope.Recorder(model, every=1000, on_spike="replay")
    (tokens,) = batches(n=1)[0]
    rec.run(0, closure_for(model, [tokens], spike=False))
    closure_for(twin, [tokens], spike=False)()
    clipped = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.1, rec.grad_norm)
    assert torch.equal(rec.grad_norm, clipped)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("bad", ["skip", "Replay", 1])
def test_on_spike_names_its_choices(bad):
    with pytest.raises(ValueError, match=r"on_spike: must be one of \['replay', None\]"):
        gradscope.Recorder(torch.nn.Linear(2, 2), on_spike=bad)


def test_the_closure_must_return_the_loss():
    model = zoo()
    rec = gradscope.Recorder(model, every=1000, on_spike="replay")
    with pytest.raises(TypeError, match="must return the step's loss"):
        rec.run(1, lambda: model(batches(1)[0][0]).sum().backward())


def test_compiled_replay_equals_compiled_always_recording():
    torch.use_deterministic_algorithms(True)
    try:
        options = ReplayOptions(window=8, min_history=4)
        model = zoo(dropout=0.0)
        twin = copy.deepcopy(model)
        data = batches(n=7)
        tables = {}
        for mode, m in (("watched", model), ("always", twin)):
            opt = torch.optim.Adam(m.parameters(), lr=1e-3)
            rec = (gradscope.Recorder(m, every=1000, on_spike=options) if mode == "watched"
                   else gradscope.Recorder(m, every=1, on_spike=options))
            compiled = torch.compile(m, fullgraph=True)
            for step, micro in enumerate(data, start=1):
                rec.run(step, closure_for(compiled, micro, spike=step == 6))
                opt.step()
                opt.zero_grad()
            assert [r.step for r in rec.watch.flagged] == [6]
            tables[mode] = rec.frame()
            rec.close()
        assert sorted(tables["watched"].step.unique()) == [6]
        assert_same_rows(step_rows(tables["watched"], 6), step_rows(tables["always"], 6))
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(a, b)
    finally:
        torch.use_deterministic_algorithms(False)
        torch._dynamo.reset()


def test_the_watch_norm_under_a_grad_scaler_is_the_unscaled_norm_clipping_uses():
    """With a GradScaler, ``rec.grad_norm`` is the norm after ``scaler.unscale_`` (it was the
    scaled norm, 1024× too large here, so clipping with it did not clip)."""
    model = zoo(dropout=0.0)
    twin = copy.deepcopy(model)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    scaler, twin_scaler = (torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2))
    rec = gradscope.Recorder(model, optimizer=opt, scaler=scaler, every=1000, on_spike="replay")
    (tokens,) = batches(n=1)[0]

    def scaled(m, s):
        def step():
            out = m(tokens[:, :-1])
            loss = F.cross_entropy(out.flatten(0, 1), tokens[:, 1:].flatten())
            s.scale(loss).backward()
            return loss.detach()
        return step

    rec.run(0, scaled(model, scaler))
    scaled(twin, twin_scaler)()
    scaler.unscale_(opt)
    twin_scaler.unscale_(twin_opt)
    clipped = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1)
    assert torch.equal(rec.grad_norm, clipped)  # (the scale is a power of two: division by it is exact)
    assert rec.watch.last.grad_norm == pytest.approx(clipped.item(), rel=1e-6)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.1, rec.grad_norm)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad)
    rec.close()


def test_the_watch_norm_when_the_closure_unscales_is_not_divided_again():
    """``scaler.unscale_(opt)`` inside the closure: the gradients are unscaled when the watch
    reads them, so its norm is theirs (a review: it was divided by the scale a second time)."""
    model = zoo(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    rec = gradscope.Recorder(model, optimizer=opt, scaler=scaler, every=1000, on_spike="replay")
    (tokens,) = batches(n=1)[0]

    def step():
        out = model(tokens[:, :-1])
        loss = F.cross_entropy(out.flatten(0, 1), tokens[:, 1:].flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        return loss.detach()

    rec.run(0, step)
    assert torch.equal(rec.grad_norm, torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    rec.close()
