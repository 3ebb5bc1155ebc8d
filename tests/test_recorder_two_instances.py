"""Two instances of one model class compiled in one process, one recorded and one not
(issue 23): the plain one never writes into the recorded one's table, whatever the order;
the recorded one records, or (plain one compiled and run before the Recorder existed)
raises as it always did. References are computed here with autograd."""

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
    """Dynamo's default (no hook guards) and no Recorder open, whatever earlier tests left alive."""
    from gradscope.recorder.wrappers import HookGuards

    monkeypatch.setattr(HookGuards, "_open", 0)
    monkeypatch.setattr(HookGuards, "_saved", None)
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

    def step():
        with rec.step(0):
            recorded(x).sum().backward()
            plain(x * 3).sum().backward()  # the plain twin, inside the recorded step, on other data

    try:
        if order == "plain_first":
            with pytest.raises(RuntimeError, match="none of the recorder's hooks fired"):
                step()
            return
        step()
        df = rec.frame().set_index(["quantity", "site"]).value
        for site in ("blocks.0.out", "blocks.1.out"):
            assert df["act_grad_norm", site] == pytest.approx(want[site], rel=1e-5), site
        assert df["act_norm", "blocks.1.out"] == pytest.approx(want["act_norm blocks.1.out"], rel=1e-5)
    finally:
        rec.close()


def test_hook_guards_are_on_while_a_recorder_is_open(no_recorder_open):
    import gc

    recs = [gradscope.Recorder(Twin()) for _ in range(2)]
    assert not torch._dynamo.config.skip_nnmodule_hook_guards
    recs[0].close()
    recs[0].close()  # twice: released once
    assert not torch._dynamo.config.skip_nnmodule_hook_guards  # the second is still open
    del recs[1]  # dropped without close(): released when collected
    gc.collect()
    assert torch._dynamo.config.skip_nnmodule_hook_guards
