"""Every forward of a micro-step counts in its act_norm, as in its act_grad_norm: the norm over
all of them, as if their batches were one (the root of the summed squares, as micro-steps
combine into the step's row). An evaluation forward before the training one was dropped
without a word (found by a new-user review); two forwards sharing one loss had their
gradients combined and only the last forward's values. References: the site tensors,
read by hooks written here, and their gradients by ``torch.autograd.grad``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from recorder_ref import assert_rel
from zoo_cases import batch, tiny

import gradscope


def _logits_loss(logits, model):
    target = torch.arange(logits.shape[:-1].numel()).reshape(logits.shape[:-1]) % model.config.vocab
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _site_tensors(model):
    """Hooks keeping every output of every Site (a view, so autograd can reach it alone)."""
    kept: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, gradscope.Site):
            def hook(mod, args, out, name=name):
                view = out.view_as(out)
                kept.setdefault(name, []).append(view)
                return view
            handles.append(m.register_forward_hook(hook))
    return kept, handles


def _recorded_and_reference(quantities, compiled):
    """A zoo decoder with a Recorder, its runner (compiled or not), a twin with the same
    weights that no recorder sees, and two batches."""
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    reference = gradscope.build_model(tiny("pre_ln", "decoder"))
    reference.load_state_dict(model.state_dict())
    rec = gradscope.Recorder(model, quantities=quantities)
    run = torch.compile(model, fullgraph=True) if compiled else model
    return model, rec, run, reference, batch(model.config, seed=0), batch(model.config, seed=1)


def _rss(values):
    return math.sqrt(sum(v * v for v in values))


def _rows(rec, step, quantity):
    df = rec.frame()
    df = df[(df.step == step) & (df.quantity == quantity) & (df.micro_step == -1)]
    return dict(zip(df.site, df.value))


@pytest.mark.parametrize("compiled", [False, True])
def test_an_evaluation_forward_before_the_training_one_counts(compiled: bool):
    model, rec, run, reference, first, second = _recorded_and_reference(["act_norm"], compiled)
    for step in range(2):  # (step 1: the compiled graphs already made)
        with rec.step(step):
            with torch.no_grad():
                run(*first)
            _logits_loss(run(*second), model).backward()
        model.zero_grad(set_to_none=True)
    kept, handles = _site_tensors(reference)
    with torch.no_grad():
        reference(*first)
        reference(*second)
    for h in handles:
        h.remove()
    got = _rows(rec, 1, "act_norm")
    assert set(got) == set(kept)
    for name, tensors in kept.items():
        assert len(tensors) == 2
        assert_rel(got[name], _rss([t.double().norm().item() for t in tensors]), rel=1e-5, what=name)


@pytest.mark.parametrize("compiled", [False, True])
def test_two_forwards_sharing_one_loss_count_in_values_and_gradients(compiled: bool):
    model, rec, run, reference, first, second = _recorded_and_reference(["act_norm", "act_grad_norm"], compiled)

    def loss_of(forward):
        return _logits_loss(forward(*first), model) + 0.5 * _logits_loss(forward(*second), model)
    for step in range(2):
        with rec.step(step):
            loss_of(run).backward()
        model.zero_grad(set_to_none=True)
    kept, handles = _site_tensors(reference)
    loss = loss_of(reference)
    for h in handles:
        h.remove()
    names = list(kept)
    grads = torch.autograd.grad(loss, [t for n in names for t in kept[n]])
    values, grad_rows = _rows(rec, 1, "act_norm"), _rows(rec, 1, "act_grad_norm")
    for k, name in enumerate(names):
        assert_rel(values[name], _rss([t.double().norm().item() for t in kept[name]]), rel=1e-5, what=f"{name} value")
        expected = _rss([g.double().norm().item() for g in grads[2 * k: 2 * k + 2]])
        assert_rel(grad_rows[name], expected, rel=1e-5, what=f"{name} gradient")


@pytest.mark.parametrize(("reentrant", "compiled"), [(False, False), (True, False), (False, True)])
def test_a_forward_that_checkpointing_recomputes_counts_once(reentrant: bool, compiled: bool):
    """Values add up over a micro-step's forwards, so a recompute in backward must not count:
    every site's act_norm (the blocks' norms recomputed inside backward too) is the norm a twin
    without checkpointing reads at that module's input or output."""
    from test_recorder_reviewed_cases import Net

    torch.manual_seed(0)
    model, x = Net(ckpt=True, reentrant=reentrant), torch.randn(2, 5, 8)
    twin = Net()
    twin.load_state_dict(model.state_dict())
    rec = gradscope.Recorder(model, quantities=["act_norm", "act_grad_norm"])
    run = torch.compile(model, fullgraph=True) if compiled else model
    for step in range(2):
        with rec.step(step):
            run(x).square().mean().backward()
    rec.close()
    got = _rows(rec, 1, "act_norm")
    modules, expected, hooks = dict(twin.named_modules()), {}, []
    for site in got:
        owner, _, where = site.rpartition(".")
        if where == "out":
            hooks.append(modules[owner].register_forward_hook(
                lambda m, a, o, site=site: expected.__setitem__(site, o.detach().double().norm().item())))
        else:
            hooks.append(modules[owner].register_forward_pre_hook(
                lambda m, a, site=site: expected.__setitem__(site, a[0].detach().double().norm().item())))
    twin(x)
    for h in hooks:
        h.remove()
    assert set(expected) == set(got) and any(".ln." in s for s in got)
    for site, value in expected.items():
        assert_rel(got[site], value, rel=1e-5, what=site)


@pytest.mark.parametrize("compiled", [False, True])
def test_an_evaluation_forward_inside_rec_paused_does_not_count(compiled: bool):
    model, rec, run, reference, first, second = _recorded_and_reference(["act_norm", "act_grad_norm"], compiled)
    for step in range(2):
        with rec.step(step):
            with rec.paused(), torch.no_grad():
                run(*first)
            _logits_loss(run(*second), model).backward()
            with rec.paused():  # (after the backward: no micro-step of its own either)
                run(*first)
        model.zero_grad(set_to_none=True)
    kept, handles = _site_tensors(reference)
    reference(*second)
    for h in handles:
        h.remove()
    got = _rows(rec, 1, "act_norm")
    assert set(got) == set(kept)
    for name, (t,) in kept.items():
        assert_rel(got[name], t.double().norm().item(), rel=1e-5, what=name)
    assert set(rec.frame().query("step == 1").micro_step) == {-1}
