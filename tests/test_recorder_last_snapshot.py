"""The end of a recorded step takes a last snapshot only when something came after the last
backward's (host cost, issue 25): a forward after the last backward is still its own
micro-step, with values checked against the site tensors read by hooks written here, and
a step that ends on its backward keeps one snapshot per backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from recorder_ref import assert_rel, site_gradients
from zoo_cases import batch, tiny

import gradscope


def _loss(run, model, inputs):
    logits = run(*inputs)
    target = torch.arange(logits.shape[:-1].numel()).reshape(logits.shape[:-1]) % model.config.vocab
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _sites(model):
    return {n: (m, "output") for n, m in model.named_modules() if isinstance(m, gradscope.Site)}


@pytest.mark.parametrize("compiled", [False, True])
def test_a_forward_after_the_last_backward_is_its_own_micro_step(compiled: bool):
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    rec = gradscope.Recorder(model)
    run = torch.compile(model, fullgraph=True) if compiled else model
    first, second = batch(model.config, seed=0), batch(model.config, seed=1)
    for step in range(2):  # (step 1: the compiled graphs already made, as in a training loop)
        with rec.step(step):
            _loss(run, model, first).backward()
            with torch.no_grad():
                _loss(run, model, second)
        model.zero_grad(set_to_none=True)
    df = rec.frame(micro_steps=True)
    df = df[(df.step == 1) & (df.quantity == "act_norm")]
    assert set(df.micro_step) == {-1, 0, 1}
    _, values = site_gradients(model, _sites(model), lambda: _loss(model, model, second))
    got = dict(zip(df[df.micro_step == 1].site, df[df.micro_step == 1].value))
    assert set(got) == set(values)
    for name, value in values.items():
        assert_rel(got[name], value.double().norm().item(), rel=1e-5, what=f"{name}, the forward after backward")


@pytest.mark.parametrize("compiled", [False, True])
def test_a_step_that_ends_on_its_backward_keeps_one_snapshot_per_backward(compiled: bool, monkeypatch):
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    rec = gradscope.Recorder(model)
    run = torch.compile(model, fullgraph=True) if compiled else model
    kept = []
    end = rec._capture.end

    def counting_end():
        snapshots, calls = end()
        kept.append(len(snapshots))
        return snapshots, calls
    monkeypatch.setattr(rec._capture, "end", counting_end)
    for step, backwards in enumerate((1, 2, 1)):
        with rec.step(step):
            for seed in range(backwards):
                _loss(run, model, batch(model.config, seed=seed)).backward()
        model.zero_grad(set_to_none=True)
    assert kept == [1, 2, 1]
    assert set(rec.frame(micro_steps=True).query("step == 1 and quantity == 'act_grad_norm'").micro_step) == {-1, 0, 1}
