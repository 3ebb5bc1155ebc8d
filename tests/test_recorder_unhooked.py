"""A Recorder whose quantities read no site (the parameters' gradient norms and logged
values, as Lightning's ``grad_norm`` or OLMo's logs) hooks no module but the root: the
model's modules run their plain call path in its recorded steps, and its rows still equal
the norms of ``p.grad`` computed here, eagerly, under accumulation and for a model compiled
before the Recorder came."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

import gradscope

D = 16


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _hooked(model: nn.Module, classes: dict[str, type]) -> list[str]:
    """The modules other than the root with a forward hook or a class not their own."""
    return [n for n, m in model.named_modules()
            if n and (type(m) is not classes[n] or m._forward_hooks or m._forward_pre_hooks)]


def _total(model: nn.Module) -> float:
    return sum(p.grad.double().square().sum().item() for p in model.parameters() if p.grad is not None) ** 0.5


def _run(model, rec, x, step, micro_steps=1):
    classes = {n: type(m) for n, m in model.named_modules()}
    with rec.step(step):
        hooked = _hooked(model, classes)
        for k in range(micro_steps):
            loss = model(x[k::micro_steps]).square().mean()
            loss.backward()
        rec.log("loss", loss)
    return hooked


@pytest.mark.parametrize("quantities", [["param_grad_norm"], ["param_grad_norm", "loss", "lr"]])
def test_parameter_norms_alone_hook_no_module_and_equal_autograd(quantities):
    model = _encoder()
    x = torch.randn(4, 6, D)
    rec = gradscope.Recorder(model, quantities=quantities)
    for step, micro in ((0, 1), (1, 2)):
        model.zero_grad(set_to_none=True)
        assert _run(model, rec, x, step, micro) == []
        got = rec.frame().query("step == @step and quantity == 'param_grad_norm' and site == ''").value
        assert len(got) == 1 and got.iloc[0] == pytest.approx(_total(model), rel=1e-6), (step, micro)
    rec.close()


def test_a_site_quantity_still_hooks_the_sites():
    model = _encoder()
    rec = gradscope.Recorder(model, quantities=["param_grad_norm", "act_norm"])
    hooked = _run(model, rec, torch.randn(2, 6, D), 0)
    rec.close()
    assert hooked, "act_norm reads the sites: their modules are hooked while the step records"
    assert set(rec.frame().quantity) >= {"param_grad_norm", "act_norm"}


def test_a_model_compiled_before_the_recorder_gives_parameter_norms_without_error():
    model = _encoder()
    run = torch.compile(model)
    x = torch.randn(2, 6, D)
    run(x).square().mean().backward()  # (compiled and run before any Recorder)
    model.zero_grad(set_to_none=True)
    rec = gradscope.Recorder(model, quantities=["param_grad_norm"])
    with rec.step(0):
        run(x).square().mean().backward()
    rec.close()
    got = rec.frame().query("quantity == 'param_grad_norm' and site == ''").value
    assert len(got) == 1 and got.iloc[0] == pytest.approx(_total(model), rel=1e-6)


def test_rows_that_wait_are_each_steps_own():
    """No hook fires, so no step needs checking at once: after the first steps the rows wait and
    are built when read; each still equals the norm of ``p.grad`` taken right after its step."""
    model = _encoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gradscope.Recorder(model, quantities=["param_grad_norm", "loss"])
    x, expected = torch.randn(4, 6, D), {}
    for step in range(6):
        opt.zero_grad(set_to_none=True)
        _run(model, rec, x, step)
        expected[step] = _total(model)
        opt.step()
    got = rec.frame().query("quantity == 'param_grad_norm' and site == ''").set_index("step").value
    rec.close()
    assert sorted(got.index) == list(expected)
    for step, want in expected.items():
        assert got[step] == pytest.approx(want, rel=1e-6), step


@pytest.mark.parametrize("evaluation", [False, True])
def test_a_step_without_backward_gives_no_stale_gradient_rows(evaluation):
    """No site is hooked, so no site sees that no backward ran: a step whose forward ran without
    a backward (or under torch.no_grad) leaves ``p.grad`` as the previous step left it. Its
    parameter rows are left out, with a warning, instead of repeating that step's norm."""
    model = _encoder()
    rec = gradscope.Recorder(model, quantities=["param_grad_norm", "loss"])
    x = torch.randn(2, 6, D)
    _run(model, rec, x, 0)
    with pytest.warns(UserWarning, match="no backward"):
        with rec.step(1):
            with torch.no_grad() if evaluation else contextlib.nullcontext():
                loss = model(x).square().mean()
            rec.log("loss", loss)
        df = rec.frame()
    rec.close()
    grads = df[df.quantity == "param_grad_norm"]
    assert set(grads.step) == {0}, grads
    assert set(df[df.quantity == "loss"].step) == {0, 1}


def test_a_step_that_only_reads_the_gradients_gives_their_rows():
    """A recorded step with no forward inside it (around the optimizer step) reads ``p.grad`` as it is."""
    model = _encoder()
    model(torch.randn(2, 6, D)).square().mean().backward()
    rec = gradscope.Recorder(model, quantities=["param_grad_norm"])
    with rec.step(0):
        pass
    got = rec.frame().query("quantity == 'param_grad_norm' and site == ''").value
    rec.close()
    assert len(got) == 1 and got.iloc[0] == pytest.approx(_total(model), rel=1e-6)


@pytest.mark.parametrize("zero", ["none", "set_to_none", "zeros"])
def test_a_backward_into_gradients_kept_from_before_is_seen(zero):
    """The step's backward is told by its gradients whatever the loop does with them between
    steps: set to None (new tensors), zeroed in place, or kept (accumulated into, the same tensors
    written again): every step has its rows, equal to ``p.grad``'s norm then."""
    model = _encoder()
    x = torch.randn(2, 6, D)
    rec = gradscope.Recorder(model, quantities=["param_grad_norm"])
    want = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "no backward" warning)
        for step in range(3):
            if zero != "none":
                model.zero_grad(set_to_none=zero == "set_to_none")
            _run(model, rec, x, step)
            want[step] = _total(model)
    got = rec.frame().query("quantity == 'param_grad_norm' and site == ''").set_index("step").value
    rec.close()
    assert sorted(got.index) == [0, 1, 2]
    for step, value in want.items():
        assert got[step] == pytest.approx(value, rel=1e-6), step


def test_gradients_zeroed_inside_a_step_without_backward_give_no_zero_rows():
    """``zero_grad(set_to_none=False)`` inside a step whose backward never runs changes every
    gradient (a new version) to 0.0: no row says 0.0 for a gradient that never came; a warning
    says why. A backward in the next step into those zeros gives its rows again."""
    model = _encoder()
    x = torch.randn(2, 6, D)
    rec = gradscope.Recorder(model, quantities=["param_grad_norm", "loss"])
    _run(model, rec, x, 0)
    with pytest.warns(UserWarning, match="zero_grad"):
        with rec.step(1):
            model.zero_grad(set_to_none=False)
            rec.log("loss", model(x).square().mean())
        rec.frame()
    _run(model, rec, x, 2)
    want = _total(model)
    df = rec.frame()
    rec.close()
    grads = df.query("quantity == 'param_grad_norm' and site == ''").set_index("step").value
    assert sorted(grads.index) == [0, 2], grads
    assert grads[2] == pytest.approx(want, rel=1e-6)
    assert set(df[df.quantity == "loss"].step) == {0, 1, 2}
