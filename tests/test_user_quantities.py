"""Quantities written outside the package (issue 24): a per-site max |h|, a per-site gradient
RMS and an end-of-step parameter statistic, on a nanoGPT-style model written here, eagerly
and under torch.compile(fullgraph=True), against autograd computed in the test.

Reference: a twin of the model (same weights, never seen by a Recorder) with this test's own
hooks. A site ``m.out`` is module m's output y, with gradient y.grad; a site ``m.in`` is
m's input x, with the gradient through m alone, ``autograd.grad(y, x, y.grad)``.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradscope
from gradscope.distributed import global_rows
from tests import stats_models


class MaxAbs(gradscope.Quantity):
    name = "act_max_abs"
    description = "max |h| over the tensor crossing a site"
    over_micro_steps = across_ranks = "max"

    def site_value(self, h):
        return h.abs().amax()


class GradRms(gradscope.Quantity):
    name = "act_grad_rms"
    description = "root mean square of ∂loss/∂h at a site"
    over_micro_steps = across_ranks = "rms"
    needs_backward = True

    def site_grad(self, grad):
        return grad.float().square().mean().sqrt()


class ParamGradMax(gradscope.Quantity):
    name = "param_grad_max"
    description = "largest |p.grad| over the model"
    needs_backward = True

    def collect(self, ctx):
        grads = [p.grad.abs().amax() for p in ctx.groups.params if p.grad is not None]
        if grads:
            ctx.add_model_value(self.name, torch.stack(grads).amax())


class RMSNorm(nn.Module):  # written by hand, as many research repos do (a fitted norm for the recorder)
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(1 + 0.1 * torch.randn(d)), eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _rms_every_other(block: int, d: int) -> nn.Module:
    return RMSNorm(d) if block % 2 == 1 else nn.LayerNorm(d)


def nano_gpt(vocab: int = 32, d: int = 16, n: int = 3) -> nn.Module:
    """nanoGPT (tests/stats_models.py) with a hand-written RMSNorm in every other block."""
    return stats_models.NanoGPT(vocab, d, n, block_norm=_rms_every_other)


def _loss(model, idx):
    logits = model(idx)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def _reference(model: nn.Module, batches: list[torch.Tensor], sites: list[str]) -> pd.DataFrame:
    """Per micro-batch and site: max |h| and the gradient RMS, with this test's own hooks."""
    modules = dict(model.named_modules())
    rows = []
    for m, idx in enumerate(batches):
        seen: dict[str, tuple] = {}

        def hook(module, args, output, name):
            output.retain_grad()
            seen[name] = (args[0], output)

        handles = [modules[s.rsplit(".", 1)[0]].register_forward_hook(lambda mod, a, o, n=s.rsplit(".", 1)[0]: hook(mod, a, o, n))
                   for s in sites if s.endswith(".out")]
        _loss(model, idx).backward(retain_graph=True)
        for h in handles:
            h.remove()
        out_grads = {name: y.grad.clone() for name, (_, y) in seen.items()}  # autograd.grad below adds to retained grads
        for site in sites:
            name, end = site.rsplit(".", 1)
            x, y = seen[name]
            h = y if end == "out" else x
            g = out_grads[name] if end == "out" else torch.autograd.grad(y, x, out_grads[name], retain_graph=True)[0]
            rows.append(dict(micro_step=m, site=site, act_max_abs=h.detach().abs().amax().item(),
                             act_grad_rms=g.double().square().mean().sqrt().item()))
    return pd.DataFrame(rows)


def _recorded(model: nn.Module, batches: list[torch.Tensor], compiled: bool) -> pd.DataFrame:
    quantities = ["act_grad_norm", MaxAbs(), GradRms(), ParamGradMax()]
    rec = gradscope.Recorder(model, quantities=quantities)
    run = torch.compile(model, fullgraph=True) if compiled else model
    with rec.step(0):
        for idx in batches:
            _loss(run, idx).backward()
    rec.close()
    return rec.frame(micro_steps=True)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_user_quantities_agree_with_autograd(compiled):
    torch.manual_seed(0)
    model = nano_gpt()
    twin = copy.deepcopy(model)
    batches = [torch.randint(0, 32, (2, 7)) for _ in range(2)]
    df = _recorded(model, batches, compiled)
    sites = gradscope.site_names(twin)
    ref = _reference(twin, batches, sites)
    # eager: the same op on the same tensor; compiled: Inductor's fused reductions, and the gradient
    # at a hand-written RMSNorm's input is its closed form (gradscope.recorder.numerics.norm_stats)
    tol = 1e-5 if compiled else 2e-6
    for quantity, how in (("act_max_abs", "max"), ("act_grad_rms", "rms")):
        got = df[df.quantity == quantity]
        assert set(got.site) == set(sites), f"{quantity}: sites {set(sites) - set(got.site)} have no rows"
        for m in range(len(batches)):
            mine = got[got.micro_step == m].set_index("site").value
            theirs = ref[ref.micro_step == m].set_index("site")[quantity]
            rel = ((mine - theirs[mine.index]).abs() / theirs[mine.index].abs()).max()
            assert rel <= tol, f"{quantity} micro-step {m}: {rel:.2e}"
        step = got[got.micro_step == -1].set_index("site").value
        per_micro = ref.pivot(index="site", columns="micro_step", values=quantity)
        expect = per_micro.max(axis=1) if how == "max" else np.sqrt((per_micro ** 2).mean(axis=1))
        rel = ((step - expect[step.index]).abs() / expect[step.index]).max()
        assert rel <= tol, f"{quantity} step row: {rel:.2e}"
    # an end-of-step quantity: the largest |p.grad| after both micro-batches
    expect = max(p.grad.abs().max().item() for p in twin.parameters() if p.grad is not None)
    got = df[df.quantity == "param_grad_max"].value
    assert len(got) == 1 and got.iloc[0] == pytest.approx(expect, rel=tol)  # compiled: Inductor's gradients, not eager's bits


def test_a_user_quantity_is_validated_and_named_in_the_error():
    class NoName(gradscope.Quantity):
        def site_value(self, h):
            return h.sum()

    class BadRule(MaxAbs):
        across_ranks = "median"

    model = nano_gpt()
    with pytest.raises(ValueError, match="NoName.name"):
        gradscope.Recorder(model, quantities=[NoName()])
    with pytest.raises(ValueError, match=r"BadRule.across_ranks: 'median'; valid: \['max'"):
        gradscope.Recorder(model, quantities=[BadRule()])
    with pytest.raises(ValueError, match="two quantities named 'act_max_abs'"):
        gradscope.Recorder(model, quantities=[MaxAbs(), MaxAbs()])
    with pytest.raises(ValueError, match="'nonfinite_grad' rows come with 'nonfinite'"):
        gradscope.Recorder(model, quantities=["nonfinite_grad"])
    with pytest.raises(TypeError, match=r"moved into options: Recorder\(model, options=gradscope.RecorderOptions\(max_calls=4\)\)"):
        gradscope.Recorder(model, max_calls=4)


def test_a_step_without_backward_gives_no_user_gradient_rows():
    model = nano_gpt()
    rec = gradscope.Recorder(model, quantities=[MaxAbs(), GradRms()])
    idx = torch.randint(0, 32, (2, 7))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rec.step(0):
            loss = _loss(model, idx)
        loss.backward()
    rec.close()
    df = rec.frame()
    assert "act_grad_rms" not in set(df.quantity) and "act_max_abs" in set(df.quantity)
    assert any("no backward inside it reached" in str(w.message) for w in caught)


def test_ranks_combine_a_user_quantity_by_its_rule():
    rows = [dict(run="r", variant="v", step=0, rank=r, site="h.0.out", quantity=q.name, value=v)
            for r, v in ((0, 1.0), (1, 3.0)) for q in (MaxAbs(), GradRms())]
    out = global_rows(gradscope.table.make_frame(rows), extra=(MaxAbs(), GradRms())).set_index("quantity").value
    assert out["act_max_abs"] == 3.0
    assert out["act_grad_rms"] == pytest.approx(np.sqrt((1.0 + 9.0) / 2))


def test_contract_mistakes_are_named():
    class Misspelled(gradscope.Quantity):
        name = "act_max"

        def site_values(self, h):  # not site_value
            return h.amax()

    class Shouting(MaxAbs):
        name = "ActMax"

    class PassesForBuiltIn(MaxAbs):
        name = "act_norm"

    class WholeTensor(MaxAbs):
        name = "act_abs"

        def site_value(self, h):
            return h.abs()

    class Elsewhere(gradscope.Quantity):
        name = "mine"

        def collect(self, ctx):
            ctx.add_model_value("loss", 1.0)

    class BothWays(MaxAbs):  # site_value and site_grad: rows of one name at the same sites
        name = "both_ways"

        def site_grad(self, grad):
            return grad.abs().amax()

    model, idx = nano_gpt(), torch.randint(0, 32, (2, 7))
    for bad, match in ((Misspelled(), r"none of site_value.*did you mean .*'site_value'"), (Shouting(), "Shouting.name"),
                       (BothWays(), r"BothWays: defines both site_value and site_grad.*make two quantities"),
                       (PassesForBuiltIn(), "a built-in quantity's name"), (MaxAbs, r"pass an instance, MaxAbs\(\)")):
        with pytest.raises(ValueError, match=match):
            gradscope.Recorder(model, quantities=[bad])
    for bad, error, match in ((WholeTensor(), TypeError, r"WholeTensor.site_value at site 'h.0.in': must return a 0-d tensor"),
                              (Elsewhere(), ValueError, r"Elsewhere.collect added values under \['loss'\]")):
        rec = gradscope.Recorder(model, quantities=[bad])
        with pytest.raises(error, match=match), rec.step(0):
            _loss(model, idx).backward()
        rec.close()
    with pytest.raises(ValueError, match="across_ranks: 'maximum'"):
        class Typo(MaxAbs):
            across_ranks = "maximum"
        global_rows(gradscope.table.make_frame([dict(step=0, quantity="act_max_abs", value=1.0)]), extra=(Typo(),))


def test_the_review_s_contract_mistakes_are_named_where_they_are_made():
    """A ``rows()`` that returns no (Key, float) rows (it broke every later ``frame()``),
    ``captures`` given as a string, a class passed to ``global_rows``, and a ``site_grad``
    that returns more than one number (its site is named, as ``site_value``'s is)."""
    class BadRows(gradscope.Quantity):
        name = "bad_rows"

        def rows(self, data):
            return [("x", 1.0)]

    class OneCapture(MaxAbs):
        name = "one_capture"
        captures = "value"

    class GradSlice(GradRms):
        name = "grad_slice"

        def site_grad(self, g):
            return g.flatten()[:3]

    model = nano_gpt()
    idx = torch.randint(0, 32, (2, 7))
    rec = gradscope.Recorder(model, quantities=["act_norm", BadRows()])
    with pytest.raises(TypeError, match=r"BadRows.rows: row 0 is \('x', 1.0\); each row is \(Key, float\)"):
        with rec.step(0):
            _loss(model, idx).backward()
    rec.close()
    with pytest.raises(ValueError, match=r"OneCapture.captures: a set of capture names, as frozenset\(\{'value'\}\)"):
        gradscope.Recorder(model, quantities=[OneCapture()])
    with pytest.raises(TypeError, match=r"a class: pass an instance, MaxAbs\(\)"):
        global_rows(gradscope.table.make_frame([dict(run="r", variant="v", step=0, quantity="act_max_abs", value=1.0)]),
                    extra=(MaxAbs,))
    rec = gradscope.Recorder(model, quantities=[GradSlice()])
    with pytest.raises(TypeError, match=r"GradSlice.site_grad at site '.+': must return a 0-d tensor"):
        with rec.step(0):
            _loss(model, idx).backward()
    rec.close()


def test_add_many_with_the_wrong_count_names_the_quantity():
    """A review: the error named neither the quantity nor its ``collect``."""
    class GroupCount(gradscope.Quantity):
        name = "group_count"

        def collect(self, ctx):
            keys = ctx.groups.keys(self.name)
            ctx.add_many(keys, torch.zeros(len(keys) + 2))

    model = nano_gpt()
    rec = gradscope.Recorder(model, quantities=[GroupCount()])
    with pytest.raises(ValueError, match=r"GroupCount.collect: StepContext.add_many: \d+ keys but \d+ values"):
        with rec.step(0):
            _loss(model, torch.randint(0, 32, (2, 7))).backward()
    rec.close()
