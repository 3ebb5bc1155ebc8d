"""The quantities read around the optimizer, against references computed here: update_ratio
of a step whose optimizer did not step (no row, not the next step's update), update_ratio
measured around an optimizer.step() inside the recorded step, and grad_rms_over_eps with
frozen parameters and a decay / no-decay split of ε. And cosine under torch.compile."""

from __future__ import annotations

import math
from contextlib import nullcontext

import numpy as np
import pytest
import torch
from torch import nn

import gradscope


def _model() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def _ratio(before: list[torch.Tensor], model: nn.Module) -> float:
    """‖Δθ‖/‖θ‖ over every parameter, in fp64."""
    delta = sum((p.detach().double() - b.double()).square().sum().item() for p, b in zip(model.parameters(), before))
    return math.sqrt(delta) / math.sqrt(sum(b.double().square().sum().item() for b in before))


def _total(rec, quantity: str) -> dict[int, float]:
    df = rec.frame().query("quantity == @quantity and site == ''")
    return dict(zip(df.step, df.value))


def _assert_update_ratios(rec, want: dict[int, float]) -> None:
    """The recorded total update_ratio of each step equals ``want`` (fp64 references); closes ``rec``."""
    got = _total(rec, "update_ratio")
    for step, value in want.items():
        assert got[step] == pytest.approx(value, rel=1e-6), step
    rec.close()


def test_a_step_whose_optimizer_did_not_step_has_no_update_ratio_and_the_next_its_own():
    model, x = _model(), torch.randn(2, 5, 16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = gradscope.Recorder(model, quantities=["update_ratio"], optimizer=opt, slow_every=1)
    want = {}
    for step in range(3):
        opt.zero_grad()
        with pytest.warns(UserWarning, match="no update_ratio row for step 0") if step == 1 else nullcontext():
            with rec.step(step):
                model(x).square().mean().backward()
        if step == 0:
            continue  # as a GradScaler does on inf gradients: no optimizer step
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        want[step] = _ratio(before, model)
    assert set(_total(rec, "update_ratio")) == {1, 2}, "a row for the step whose optimizer did not step"
    _assert_update_ratios(rec, want)


def test_an_optimizer_step_inside_the_recorded_step_is_that_step_s_update():
    model, x = _model(), torch.randn(2, 5, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gradscope.Recorder(model, quantities=["update_ratio"], optimizer=opt, slow_every=1)
    want = {}
    for step in range(2):
        with rec.step(step):
            model(x).square().mean().backward()
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        want[step] = _ratio(before, model)
    _assert_update_ratios(rec, want)


def test_grad_rms_over_eps_counts_what_the_optimizer_steps_with_each_parameter_s_eps():
    """sqrt(Σ ‖g_p‖²/ε_p² / Σ n_p) over parameters with a gradient: one frozen weight, and
    biases in an optimizer group of their own ε."""
    model, x = _model(), torch.randn(2, 5, 16)
    frozen = model.layers[1].linear1.weight
    frozen.requires_grad_(False)
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    weights = [p for n, p in model.named_parameters() if not n.endswith("bias") and p.requires_grad]
    opt = torch.optim.Adam([{"params": weights, "eps": 1e-8}, {"params": biases, "eps": 1e-6}])
    rec = gradscope.Recorder(model, quantities=["grad_rms_over_eps"], optimizer=opt)
    with rec.step(0):
        model(x).square().mean().backward()
    eps = {id(p): 1e-8 for p in weights} | {id(p): 1e-6 for p in biases}

    def reference(prefix: str) -> float:
        members = [p for n, p in model.named_parameters() if n.startswith(prefix) and p.grad is not None]
        over = sum(p.grad.double().square().sum().item() / eps[id(p)] ** 2 for p in members)
        return math.sqrt(over / sum(p.numel() for p in members))

    df = rec.frame().query("quantity == 'grad_rms_over_eps'").set_index("site").value
    for site, prefix in (("", ""), ("layers.1", "layers.1."), ("layers.1.linear1", "layers.1.linear1."),
                         ("layers.0.linear2", "layers.0.linear2.")):
        assert df[site] == pytest.approx(reference(prefix), rel=1e-6), site
    rec.close()


def test_cosine_under_compile_equals_eager():
    """The cosine token masks are asked for inside the compiled forward (a function of the
    model, which Dynamo traces)."""
    x = torch.randn(2, 5, 16)
    got = {}
    for compiled in (False, True):
        model = _model()
        rec = gradscope.Recorder(model, quantities=["cosine"])
        run = torch.compile(model, fullgraph=True) if compiled else model
        with rec.step(0):
            run(x).square().mean().backward()
        df = rec.frame().query("quantity == 'cosine'")
        got[compiled] = dict(zip(zip(df.layer, df.layer_j), df.value))
        rec.close()
    assert got[True] and got[True].keys() == got[False].keys()
    for key, value in got[False].items():
        assert got[True][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_a_step_opened_inside_optimizer_step_closure_is_that_step_s_update():
    """As Lightning does (its hooks, and a spike replay, run in the closure that
    ``optimizer.step(closure)`` calls before the parameters change)."""
    model, x = _model(), torch.randn(2, 5, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gradscope.Recorder(model, quantities=["update_ratio"], optimizer=opt, slow_every=1)
    want = {}
    for step in range(2):
        def closure(step=step):
            opt.zero_grad()
            with rec.step(step):
                loss = model(x).square().mean()
                loss.backward()
            return loss

        before = [p.detach().clone() for p in model.parameters()]
        opt.step(closure)
        want[step] = _ratio(before, model)
    _assert_update_ratios(rec, want)


def test_update_ratio_asked_for_without_an_optimizer_says_so():
    model, x = _model(), torch.randn(2, 5, 16)
    rec = gradscope.Recorder(model, quantities=["update_ratio"], slow_every=1)
    with pytest.warns(UserWarning, match="update_ratio is measured around optimizer.step"), rec.step(0):
        model(x).square().mean().backward()
    rec.close()


def test_log_of_a_tensor_that_is_not_a_scalar_names_the_quantity():
    model = _model()
    rec = gradscope.Recorder(model)
    with pytest.raises(ValueError, match=r"Recorder.log\('loss', ...\): the value must be a scalar.*\(3,\)"):
        with rec.step(0):
            rec.log("loss", torch.ones(3))
    with pytest.raises(ValueError, match=r"Recorder.log\('val', ...\): the value must be a scalar.*ndarray of shape \(2,\)"):
        rec.log("val", np.ones(2), step=0)
    with pytest.raises(ValueError, match="every: must be an integer >= 1, got True"):
        gradscope.Recorder(model, every=True)
    with rec.step(1):  # one element of any kind is a scalar
        rec.log("loss", np.array([2.5]))
        rec.log("loss", torch.tensor([[1.5]]))
    rec.log("val", np.array([0.5]), step=1)
    rec.close()
    logged = rec.frame(micro_steps=True).query("quantity in ['loss', 'val'] and step == 1")
    assert sorted(logged.value) == [0.5, 1.5, 2.0, 2.5]  # (two micro-steps of loss and their mean)


def test_update_ratio_of_a_group_at_zero_is_no_row_but_a_warning():
    """transparent_attention's memory weights start at 0: ‖Δθ‖/‖θ‖ is undefined there (the row
    held 2e36, ‖Δθ‖ over the smallest float)."""
    import warnings

    import torch.nn.functional as F

    torch.manual_seed(0)
    model = gradscope.build_model(gradscope.presets.tiny(variant="transparent_attention"))
    assert all(p.abs().sum() == 0 for n, p in model.named_parameters() if n.startswith("memory"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec = gradscope.Recorder(model, quantities=["update_ratio"], optimizer=opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    src, tgt = torch.randint(3, 64, (4, 12)), torch.randint(3, 64, (4, 10))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rec.step(0):
            F.cross_entropy(model(src, tgt).reshape(-1, 64), tgt.reshape(-1)).backward()
        opt.step()
    rec.close()
    rows = rec.frame().query("quantity == 'update_ratio'").set_index("site").value
    assert "memory" not in rows.index and len(rows) > 5 and np.isfinite(rows).all()
    assert any("update_ratio of group(s) ['memory'] is undefined" in str(w.message) for w in caught)
    total = sum((p.detach() - before[n]).double().square().sum() for n, p in model.named_parameters()) ** 0.5
    base = sum(b.double().square().sum() for b in before.values()) ** 0.5
    assert rows[""] == pytest.approx((total / base).item(), rel=1e-5)


def test_lr_is_the_one_the_update_used_when_the_scheduler_steps_inside_the_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    rec = gradscope.Recorder(model, optimizer=opt, quantities=["lr"])
    used = []
    for step in range(3):
        with rec.step(step):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            used.append(opt.param_groups[0]["lr"])
            opt.step()
            opt.zero_grad()
            schedule.step()  # (before the step ends: param_groups already hold the next lr)
    with rec.step(3):  # no optimizer step inside: the lr of the groups when the step ends
        model(torch.randn(8, 4)).pow(2).mean().backward()
    rec.close()
    assert rec.frame().query("quantity == 'lr'").sort_values("step").value.tolist() == used + [0.125]


def test_update_ratio_of_groups_another_optimizer_steps_is_no_row_but_a_warning():
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    first, second = torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[1].parameters(), lr=0.1)
    rec = gradscope.Recorder(model, optimizer=first, quantities=["update_ratio"], slow_every=1)
    before = [p.detach().clone() for p in model[0].parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rec.step(0):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            first.step()
            second.step()
    rec.close()
    rows = rec.frame().query("quantity == 'update_ratio'").set_index("site").value
    assert list(rows.index) == ["0"]  # (the total and group '1' had 0.0 for the other optimizer's update)
    delta = sum((p.detach() - b).square().sum() for p, b in zip(model[0].parameters(), before)) ** 0.5
    assert rows["0"] == pytest.approx((delta / sum(b.square().sum() for b in before) ** 0.5).item(), rel=1e-5)
    assert any("the attached optimizer does not step" in str(w.message) for w in caught)
