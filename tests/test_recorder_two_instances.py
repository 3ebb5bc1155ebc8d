"""Two instances of one model class compiled in one process, one recorded and one not
(issue 23): the plain one never writes into the recorded one's table and the recorded one
records, whatever the order (also when the plain one was compiled and run before the
Recorder existed), with Dynamo's default settings. References are computed here with
autograd."""

from __future__ import annotations

import pytest
import torch
from twin_models import Twin

import gradscope


def _reference(model: Twin, x: torch.Tensor) -> dict[str, float]:
    h0 = model.blocks[0](x)
    h0.retain_grad()
    h1 = model.blocks[1](h0)
    h1.sum().backward()
    model.zero_grad()
    return {"blocks.0.out": h0.grad.norm().item(), "blocks.1.out": h1.numel() ** 0.5,
            "act_norm blocks.1.out": h1.detach().norm().item()}


@pytest.fixture
def no_recorder_open(monkeypatch):
    """Dynamo's default (no guards on empty hook dicts) and no Recorder open, whatever earlier tests left alive."""
    from gradscope.recorder.capture.compile_settings import DynamoSettings

    monkeypatch.setattr(DynamoSettings, "_open", 0)
    monkeypatch.setattr(DynamoSettings, "_saved", None)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):  # restored afterwards
        yield


@pytest.mark.parametrize("order", ["recorded_first", "recorder_then_plain", "plain_first"])
def test_a_plain_twin_never_writes_into_the_recorded_table(order, no_recorder_open):
    torch._dynamo.reset()
    torch.manual_seed(0)
    a, b, x = Twin(), Twin(), torch.randn(2, 3, 8)
    want = _reference(a, x)
    if order == "plain_first":
        plain = torch.compile(b, fullgraph=True)
        plain(x).sum().backward()
        rec = gradscope.Recorder(a)
        recorded = torch.compile(a, fullgraph=True)
    elif order == "recorder_then_plain":
        rec = gradscope.Recorder(a)
        plain = torch.compile(b, fullgraph=True)
        plain(x).sum().backward()
        recorded = torch.compile(a, fullgraph=True)
    else:
        rec = gradscope.Recorder(a)
        recorded = torch.compile(a, fullgraph=True)
        recorded(x).sum().backward()
        plain = torch.compile(b, fullgraph=True)
    a.zero_grad()

    def step(i):
        with rec.step(i):
            recorded(x).sum().backward()
            plain(x * 3).sum().backward()  # the plain twin, inside the recorded step, on other data

    try:
        step(0)
        step(1)  # the second time from Dynamo's cache
        df = rec.frame().set_index(["step", "quantity", "site"]).value
        for i in (0, 1):
            for site in ("blocks.0.out", "blocks.1.out"):
                assert df[i, "act_grad_norm", site] == pytest.approx(want[site], rel=1e-5), (i, site)
            assert df[i, "act_norm", "blocks.1.out"] == pytest.approx(want["act_norm blocks.1.out"], rel=1e-5)
    finally:
        rec.close()


def test_dynamo_hook_setting_is_left_alone_and_classes_come_back(no_recorder_open):
    import gc

    twins = [Twin() for _ in range(2)]
    classes = [[type(m) for m in t.modules()] for t in twins]
    recs = [gradscope.Recorder(t) for t in twins]
    assert torch._dynamo.config.skip_nnmodule_hook_guards  # a Recorder needs no hook guards
    with recs[0].step(0):
        assert type(twins[0].blocks[0]) is not type(twins[1].blocks[0])  # armed: a class of its own
        assert isinstance(twins[0].blocks[0], type(twins[1].blocks[0]))  # the armed twin class
        assert type(twins[0].blocks[0]).__name__ == type(twins[1].blocks[0]).__name__
        twins[0](torch.randn(2, 3, 8)).sum().backward()
    assert [type(m) for m in twins[0].modules()] == classes[0]  # disarmed: the classes are back
    recs[0].close()
    recs[0].close()  # twice: released once
    assert [type(m) for m in twins[0].modules()] == classes[0]
    del recs[1]  # dropped without close(): released when collected
    gc.collect()
    assert [type(m) for m in twins[1].modules()] == classes[1]
    assert torch._dynamo.config.skip_nnmodule_hook_guards


def test_two_recorders_on_one_model_keep_it_armed_until_both_end(no_recorder_open):
    model = Twin()
    own = [type(m) for m in model.modules()]
    a, b = gradscope.Recorder(model), gradscope.Recorder(model)
    a.begin_step(0)
    b.begin_step(0)
    model(torch.randn(2, 3, 8)).sum().backward()
    a.end_step()
    assert type(model.blocks[0]) is not own[list(model.modules()).index(model.blocks[0])]  # b still records
    b.end_step()
    assert [type(m) for m in model.modules()] == own
    a.close()
    b.close()
    assert [type(m) for m in model.modules()] == own
    assert not a.frame().empty and not b.frame().empty


def test_a_model_copied_or_saved_inside_a_recorded_step_is_a_plain_model(no_recorder_open, tmp_path):
    """copy.deepcopy and torch.save inside a recorded step (after its forward): the copy has
    the model's own classes and none of the recorder's hooks, computes what the model does,
    and the recorded rows equal autograd."""
    import copy

    torch.manual_seed(0)
    model, x = Twin(), torch.randn(2, 3, 8)
    own = [type(m) for m in model.modules()]
    want = _reference(copy.deepcopy(model), x)
    rec = gradscope.Recorder(model)
    with rec.step(0):
        out = model(x)
        snapshot = copy.deepcopy(model)
        torch.save(model, tmp_path / "model.pt")
        out.sum().backward()
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for other in (snapshot, loaded):
        assert [type(m) for m in other.modules()] == own
        assert not any(d for m in other.modules() for d in (m._forward_hooks, m._forward_pre_hooks))
        assert torch.equal(other(x), model(x))
    df = rec.frame().set_index(["quantity", "site"]).value
    assert df["act_grad_norm", "blocks.0.out"] == pytest.approx(want["blocks.0.out"], rel=1e-5)
    rec.close()


def test_an_id_left_by_a_module_collected_while_armed_does_not_keep_another_armed(no_recorder_open):
    """A Recorder dropped inside a step leaves its modules' arm counts behind; a new module
    that gets one of their ids still has its own class back after its step."""
    import weakref

    from gradscope.recorder.capture import hookset

    model = Twin()
    own = [type(m) for m in model.modules()]
    gone = torch.nn.Linear(2, 2)
    for m in model.modules():  # as if a collected module had held these ids, armed twice
        hookset._ARMS[id(m)] = (weakref.ref(gone), 2)
    rec = gradscope.Recorder(model)
    with rec.step(0):
        model(torch.randn(2, 3, 8)).sum().backward()
    assert [type(m) for m in model.modules()] == own
    rec.close()
    for m in model.modules():  # (the entries planted on modules without a recorder hook)
        hookset._ARMS.pop(id(m), None)
