"""The zoo's second promise (``site_inputs_used_only_through_the_site``): a Site whose input
nothing else reads keeps the gradient of the tensor it passes on, with no alias
(recorder/site_plan.py ``direct``). Every zoo variant and architecture is checked against
the site gradients autograd gives here (a view at each site), against the same recorder
with an alias at every site, and for training unchanged."""

from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch
from recorder_ref import assert_rel, site_gradients
from zoo_cases import ALL_CASES, batch, loss_of, tiny

import gradscope


def _record(model, inputs, config, *, aliases_everywhere: bool, steps: int = 1) -> tuple[pd.DataFrame, int]:
    """Trains ``steps`` recorded steps (SGD); returns the table and how many sites were direct."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gradscope.Recorder(model)
    if aliases_everywhere:
        rec._capture._direct = [False] * len(rec._capture._direct)
    direct = sum(rec._capture._direct)
    for step in range(steps):
        with rec.step(step):
            loss_of(model(*inputs), config).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    rec.close()
    return rec.frame(), direct


@pytest.mark.parametrize("variant,arch", ALL_CASES)
def test_direct_sites_give_each_site_its_own_gradient(variant, arch):
    config = tiny(variant, arch)
    torch.manual_seed(0)
    model = gradscope.build_model(config)
    twin, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    inputs = batch(config)
    got, direct = _record(model, inputs, config, aliases_everywhere=False)
    aliased, none = _record(twin, inputs, config, aliases_everywhere=True)
    assert direct > 0 and none == 0  # (the plan is exercised)
    pd.testing.assert_frame_equal(got, aliased)  # the same table, to the bit
    sites = {n: (m, "output") for n, m in ref_model.named_modules() if isinstance(m, gradscope.Site)}
    ref, _ = site_gradients(ref_model, sites, lambda: loss_of(ref_model(*inputs), config))
    rows = got[(got.quantity == "act_grad_norm") & (got.micro_step == -1)]
    recorded = dict(zip(rows.site, rows.value))
    assert ref.keys() <= recorded.keys()
    for name, value in ref.items():
        assert_rel(recorded[name], value, rel=1e-5, what=f"{variant}/{arch} {name}")


def _trained(variant: str, how: str) -> list[torch.Tensor]:
    """The weights after three SGD steps with dropout: recorded (``direct`` or ``aliased``:
    an alias at every site) or ``plain`` (no recorder)."""
    config = tiny(variant, dropout=0.1)
    torch.manual_seed(0)
    model = gradscope.build_model(config)
    inputs = batch(config)
    torch.manual_seed(1)
    if how == "plain":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            loss_of(model(*inputs), config).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        _record(model, inputs, config, aliases_everywhere=how == "aliased", steps=3)
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("variant", ["pre_ln", "post_ln", "dlcl_pre", "transparent_attention"])
def test_direct_sites_train_as_aliases_do(variant):
    """Three SGD steps with dropout: the weights equal a copy's recorded with an alias at
    every site, to the bit."""
    for p, q in zip(_trained(variant, "direct"), _trained(variant, "aliased")):
        assert torch.equal(p, q)


@pytest.mark.parametrize("variant", [
    "pre_ln", "post_ln", "dlcl_pre",
    pytest.param("transparent_attention", marks=pytest.mark.xfail(strict=True, reason=(
        "known: a layer's input that the stack also keeps (transparent attention) has three readers; the "
        "alias at the layer's in site adds two of their gradients first, which changes the sum's rounding "
        "(≈1e-7 relative in the encoder's gradients; issue 25's closing note)"))),
])
def test_recorded_training_is_bit_identical_to_plain(variant):
    """Three SGD steps with dropout: the weights equal a copy's trained with no recorder, to the bit."""
    for p, q in zip(_trained(variant, "direct"), _trained(variant, "plain")):
        assert torch.equal(p, q)


def test_a_gradient_someone_else_keeps_is_left_to_them():
    """A user's hook (registered before the Recorder) keeps the gradient of the tensor a
    direct Site passes on, and a second Recorder records the same model: the Recorder then
    reads that site at an alias, the user's ``.grad`` stays as autograd made it, and both
    Recorders' tables equal a lone Recorder's."""
    config = tiny("pre_ln")
    torch.manual_seed(0)
    model = gradscope.build_model(config)
    lone_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    inputs = batch(config)
    name = "encoder.layers.0.self_attn.sum"
    kept = {}

    def keep(module, args, out):
        out.retain_grad()
        kept["t"] = out
    model.get_submodule(name).register_forward_hook(keep)
    first, second = gradscope.Recorder(model), gradscope.Recorder(model)
    for rec in (first, second):
        rec.begin_step(0)
    loss_of(model(*inputs), config).backward()
    for rec in (first, second):
        rec.end_step()
        rec.close()
    lone, _ = _record(lone_model, inputs, config, aliases_everywhere=False)
    pd.testing.assert_frame_equal(first.frame(), lone)
    pd.testing.assert_frame_equal(second.frame(), lone)
    ref, _ = site_gradients(ref_model, {name: (ref_model.get_submodule(name), "output")},
                            lambda: loss_of(ref_model(*inputs), config))
    assert kept["t"].grad is not None
    assert_rel(kept["t"].grad.norm().item(), ref[name], rel=1e-6, what="the user's kept gradient")
