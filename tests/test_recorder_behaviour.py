"""The recorder changes nothing, leaves nothing behind, and stays right under gradient
accumulation, AMP GradScaler and activation checkpointing."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import gradscope
from recorder_ref import all_hook_dicts_empty, assert_rel, site_gradients
from zoo_cases import batch, tiny


def loss_fn(model, inputs):
    """Cross entropy with targets that depend on each sample's own tokens only."""
    logits = model(*inputs)
    target = (inputs[-1] * 7 + 3) % model.config.vocab
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def train(model, steps, rec=None):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.98))
    if rec is not None and rec.optimizer is None:
        rec.optimizer = None
    for step in range(steps):
        inputs = batch(model.config, seed=step)
        if rec is None:
            loss_fn(model, inputs).backward()
        else:
            with rec.step(step):
                loss = loss_fn(model, inputs)
                loss.backward()
                rec.log("loss", loss)
        opt.step()
        opt.zero_grad()
    return opt


# Transparent attention: an encoder layer's input has three readers (the layer's norm, its
# residual, the memory); the alias at the layer's ``in`` Site adds the first two gradients
# before autograd adds the third, so the sum rounds differently (≈1e-7 relative).
_ROUNDS_DIFFERENTLY = pytest.mark.xfail(strict=True, reason=(
    "known: the alias at a layer's in Site pre-adds two of its input's three gradients under transparent "
    "attention (benchmarks/RESULTS.md, issue 25's closing note of 2026-11-27)"))


@pytest.mark.parametrize("variant", [pytest.param(v, marks=_ROUNDS_DIFFERENTLY) if v == "transparent_attention" else v
                                     for v in sorted(gradscope.VARIANTS)])
def test_training_is_bit_identical_with_and_without_recorder(variant):
    config = tiny(variant, dropout=0.1)
    torch.manual_seed(0)
    plain = gradscope.build_model(config)
    torch.manual_seed(0)
    watched = gradscope.build_model(config)
    torch.manual_seed(1)
    train(plain, 5)
    torch.manual_seed(1)
    opt = torch.optim.Adam(watched.parameters(), lr=1e-2, betas=(0.9, 0.98))
    rec = gradscope.Recorder(watched, quantities="all", optimizer=opt, slow_every=2)
    for step in range(5):
        with rec.step(step):
            loss = loss_fn(watched, batch(config, seed=step))
            loss.backward()
            rec.log("loss", loss)
        opt.step()
        opt.zero_grad()
    rec.close()
    assert len(rec.frame()) > 0
    for (n, a), (_, b) in zip(plain.named_parameters(), watched.named_parameters()):
        assert torch.equal(a, b), n


def test_no_hook_left_after_close_context_and_exception():
    model = gradscope.build_model(tiny("pre_ln"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gradscope.Recorder(model, quantities="all", optimizer=opt)
    assert all_hook_dicts_empty(model) == []  # the hooks are armed only while a step records...
    with rec.step(1):
        assert all_hook_dicts_empty(model)
        loss_fn(model, batch(model.config)).backward()
    assert all_hook_dicts_empty(model) == []
    with rec.step(2):
        assert all_hook_dicts_empty(model)
    rec.close()
    assert all_hook_dicts_empty(model) == []  # ...and gone after close()
    rec = gradscope.Recorder(model, quantities="all", optimizer=opt)
    with pytest.raises(RuntimeError, match="boom"):
        with rec.step(2):
            model(*batch(model.config))
            raise RuntimeError("boom")
    with rec.step(3):
        loss_fn(model, batch(model.config)).backward()
    rec.close()
    assert all_hook_dicts_empty(model) == []
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    with pytest.raises(RuntimeError, match="boom"):
        with gradscope.record(model):
            raise RuntimeError("boom")
    assert all_hook_dicts_empty(model) == []
    assert sorted(rec.frame().step.unique()) == [3]  # the failed step left no rows


def test_stale_graph_after_exception_does_not_write():
    model = gradscope.build_model(tiny("post_ln"))
    rec = gradscope.Recorder(model)
    with pytest.raises(ValueError):
        with rec.step(0):
            loss = loss_fn(model, batch(model.config))
            raise ValueError
    loss.backward()  # tensor hooks of the aborted step were removed
    assert len(rec.frame()) == 0


def test_gradient_accumulation_per_micro_step_and_accumulated():
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("post_ln", "decoder"))
    micro_batches = [batch(model.config, seed=s) for s in range(3)]
    with gradscope.record(model) as rec:
        for inputs in micro_batches:
            (loss_fn(model, inputs) / 3).backward()
    df = rec.frame(micro_steps=True)
    sites = {n: (m, "output") for n, m in model.named_modules() if isinstance(m, gradscope.Site)}
    model.zero_grad()
    refs = [site_gradients(model, sites, lambda inputs=inputs: loss_fn(model, inputs) / 3)[0] for inputs in micro_batches]
    for name in sites:
        for m in range(3):
            row = df[(df.site == name) & (df.quantity == "act_grad_norm") & (df.micro_step == m)]
            assert_rel(row.value.item(), refs[m][name], what=f"{name} micro {m}")
        acc = df[(df.site == name) & (df.quantity == "act_grad_norm") & (df.micro_step == -1)].value.item()
        assert_rel(acc, math.sqrt(sum(r[name] ** 2 for r in refs)), what=name)
    # the accumulated value equals the norm on the whole batch (same loss scaling, equal sizes)
    whole = tuple(torch.cat(parts) for parts in zip(*micro_batches))
    ref_whole, _ = site_gradients(model, sites, lambda: loss_fn(model, whole))
    name = "decoder.layers.0.out"
    acc = df[(df.site == name) & (df.quantity == "act_grad_norm") & (df.micro_step == -1)].value.item()
    assert_rel(acc, ref_whole[name], rel=1e-4, what="whole batch")
    # parameter gradients: only the accumulated p.grad
    pg = df[(df.quantity == "param_grad_norm") & (df.site == "")]
    assert list(pg.micro_step) == [-1]
    model.zero_grad()
    for inputs in micro_batches:
        (loss_fn(model, inputs) / 3).backward()
    assert_rel(pg.value.item(), math.sqrt(sum(p.grad.norm().item() ** 2 for p in model.parameters())))


@pytest.mark.parametrize("inside", ["nothing", "unscale", "step", "step_update", "step_without_optimizer",
                                    "step_update_without_optimizer"])
def test_grad_scaler_values_are_unscaled(inside):
    """Norms divided by the scale the backward ran with, the parameters' only if still scaled,
    whatever the loop does inside the step: ``unscale_``, ``scaler.step`` (which unscales in
    place) and ``scaler.update`` (which doubles the scale here). Without the optimizer the
    Recorder cannot tell whether ``scaler.step`` unscaled them: no parameter rows, and it says so."""
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    inputs = batch(model.config)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rec = gradscope.Recorder(model, scaler=scaler, optimizer=None if inside.endswith("without_optimizer") else opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rec.step(0):
            scaler.scale(loss_fn(model, inputs)).backward()
            if inside == "unscale":
                scaler.unscale_(opt)
            if inside.startswith("step"):
                scaler.step(opt)
            if "update" in inside:
                scaler.update()
    rec.close()
    assert scaler.get_scale() == (2048.0 if "update" in inside else 1024.0)
    assert any("scaler.step() ran inside" in str(w.message) for w in caught) == inside.endswith("without_optimizer")
    df = rec.frame()
    model.zero_grad()
    sites = {n: (m, "output") for n, m in model.named_modules() if isinstance(m, gradscope.Site)}
    ref, _ = site_gradients(model, sites, lambda: loss_fn(model, inputs))
    for name, value in ref.items():
        got = df[(df.site == name) & (df.quantity == "act_grad_norm")].value.item()
        assert_rel(got, value, rel=1e-4, what=name)
    loss_fn(model, inputs).backward()
    total = math.sqrt(sum(p.grad.norm().item() ** 2 for p in model.parameters()))
    got = df[(df.site == "") & (df.quantity == "param_grad_norm")].value
    if inside.endswith("without_optimizer"):  # (scaled or not cannot be known: no row rather than a guess)
        assert got.empty
    else:
        assert_rel(got.item(), total, rel=1e-4)


class CheckpointedLM(torch.nn.Module):
    """A zoo decoder whose layers run under activation checkpointing."""

    def __init__(self, model, use_reentrant):
        super().__init__()
        self.inner = model
        self.use_reentrant = use_reentrant
        for layer in model.decoder.layers:
            layer.forward = self._wrap(layer.forward)

    def _wrap(self, fn):
        return lambda x, ctx: checkpoint(fn, x, ctx, use_reentrant=self.use_reentrant)

    def forward(self, tokens):
        return self.inner(tokens)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_counts_each_site_once(use_reentrant):
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    inputs = batch(model.config)
    sites = {n: (m, "output") for n, m in model.named_modules() if isinstance(m, gradscope.Site)}
    ref, _ = site_gradients(model, sites, lambda: loss_fn(model, inputs))
    model.zero_grad()
    wrapped = CheckpointedLM(model, use_reentrant)
    rec = gradscope.Recorder(model, quantities=["act_grad_norm", "act_norm", "ln_w_over_sigma"])
    with rec.step(0):
        logits = wrapped(*inputs)
        target = (inputs[-1] * 7 + 3) % model.config.vocab
        F.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
    df = rec.frame()
    grads = df[df.quantity == "act_grad_norm"]
    assert grads.site.is_unique and len(df[df.quantity == "act_norm"]) == len(sites)
    assert df[df.quantity == "ln_w_over_sigma"].site.is_unique
    for name, value in ref.items():
        assert_rel(grads[grads.site == name].value.item(), value, what=name)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_w_over_sigma_under_checkpointing_equals_plain(use_reentrant):
    """w/σ is read from LayerNorm's saved 1/σ only outside saved-tensor hooks; under
    checkpointing it is computed from the input instead (reading a saved tensor there would
    recompute the layer), and the values agree."""
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    with torch.no_grad():
        for m in norms:
            m.weight.uniform_(0.5, 1.5)
    calls = []
    for m in norms:
        m.register_forward_hook(lambda *_: calls.append(1))
    inputs = batch(model.config)
    target = (inputs[-1] * 7 + 3) % model.config.vocab

    def w_sigma(net, recorded=True):
        calls.clear()
        rec = gradscope.Recorder(model, quantities=["ln_w_over_sigma"])
        with rec.step(0) if recorded else contextlib.nullcontext():
            F.cross_entropy(net(*inputs).flatten(0, 1), target.flatten()).backward()
        model.zero_grad()
        got = rec.frame()
        return dict(zip(got.site, got.value)), len(calls)

    plain, _ = w_sigma(model)
    wrapped = CheckpointedLM(model, use_reentrant)  # wraps the layers in place, once
    checkpointed, n_recorded = w_sigma(wrapped)
    _, n_unrecorded = w_sigma(wrapped, recorded=False)
    assert n_recorded == n_unrecorded, "recording made checkpointing recompute more"
    assert plain.keys() == checkpointed.keys() and len(plain) > 2
    for site, value in plain.items():
        assert_rel(checkpointed[site], value, rel=1e-5, what=site)


def test_recording_memory_is_flat(tmp_path):

    torch.manual_seed(0)
    model = gradscope.build_model(tiny("post_ln", "decoder"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rec = gradscope.Recorder(model, quantities="all", optimizer=opt, slow_every=5)
    inputs = batch(model.config)

    def run(steps, start):
        for step in range(start, start + steps):
            with rec.step(step):
                loss = loss_fn(model, inputs)
                loss.backward()
                rec.log("loss", loss)
            opt.step()
            opt.zero_grad()

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    run(50, 0)
    at_50 = rss_mb()
    run(450, 50)
    at_500 = rss_mb()
    rows_per_step = len(rec.frame()) / 500
    # The table grows by design (~20 bytes per stored row); everything else must stay flat.
    allowance = 450 * rows_per_step * 64 / 2**20 + 8
    assert at_500 - at_50 < allowance, (at_50, at_500, allowance)
