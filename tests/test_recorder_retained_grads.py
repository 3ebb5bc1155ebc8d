"""Eager gradients read at the end of each backward (issue 25): a promising model's site
aliases keep their gradients (``retain_grad``) and the end of each backward reads them.
Two backwards through one graph each bring their own gradients; a backward that
stops before the first site of the forward (where the reading is queued) is still read,
when the step ends. References are computed here with autograd on a copy."""

from __future__ import annotations

import copy

import pytest
import torch
from zoo_cases import batch, loss_of, tiny

import gradscope


def _model():
    torch.manual_seed(0)
    return gradscope.build_model(tiny("pre_ln", "decoder"))


def _reference(model, sites: list[str], inputs=None) -> dict[str, float]:
    """‖∂loss/∂site‖ by autograd on a copy; ``inputs``: the backward's inputs (None: all)."""
    twin = copy.deepcopy(model)
    kept: dict[str, torch.Tensor] = {}
    handles = []
    for name in sites:
        def hook(module, args, out, name=name):
            out = out.view_as(out)
            out.retain_grad()
            kept[name] = out
            return out
        handles.append(twin.get_submodule(name).register_forward_hook(hook))
    loss = loss_of(twin(*batch(twin.config)), twin.config)
    wanted = None if inputs is None else [twin.get_parameter(n) for n in inputs]
    loss.backward(inputs=wanted)
    for h in handles:
        h.remove()
    return {n: t.grad.norm().item() for n, t in kept.items() if t.grad is not None}


def _rows(rec, micro: int) -> dict[str, float]:
    df = rec.frame().query("quantity == 'act_grad_norm' and micro_step == @micro")
    return dict(zip(df.site, df.value))


def test_two_backwards_through_one_graph_each_bring_their_own_gradients():
    """The step's row holds sqrt(Σ over backwards of ‖g‖²): √2·‖g‖ for two equal backwards.
    A second backward whose gradient was lost would give ‖g‖, one added onto the first √5·‖g‖."""
    model = _model()
    sites = ["decoder.embed.out", "decoder.layers.1.out", "decoder.final_norm.out"]
    want = _reference(model, sites)
    rec = gradscope.Recorder(model)
    with rec.step(0):
        loss = loss_of(model(*batch(model.config)), model.config)
        loss.backward(retain_graph=True)
        loss.backward()
    got = _rows(rec, -1)
    for site in sites:
        assert got[site] == pytest.approx(2 ** 0.5 * want[site], rel=1e-5), site
    rec.close()


def test_a_backward_that_stops_before_the_first_site_is_read_when_the_step_ends():
    model = _model()
    last = ["decoder.layers.2.ffn.fn.fc2.weight", "decoder.final_norm.inner.weight"]
    sites = ["decoder.layers.2.out", "decoder.final_norm.out", "decoder.embed.out"]
    want = _reference(model, sites, inputs=last)
    assert "decoder.embed.out" not in want and len(want) == 2  # backward stopped before the first site
    rec = gradscope.Recorder(model)
    with pytest.warns(UserWarning, match="did not reach them"), rec.step(0):
        loss = loss_of(model(*batch(model.config)), model.config)
        loss.backward(inputs=[model.get_parameter(n) for n in last])
    got = _rows(rec, -1)
    for site, value in want.items():
        assert got[site] == pytest.approx(value, rel=1e-5), site
    assert "decoder.embed.out" not in got, "a row (0.0) for a site the backward did not reach"
    rec.close()
