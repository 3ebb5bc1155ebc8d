"""Between recorded steps a model carries none of the recorder's hooks, compiled or not
(issue 25): an unrecorded compiled step runs the graph of the model without hooks (guarded
as a plain model's, so it costs what a plain step does) and a recorded one the graph with
them; alternating compiles each once, and the recorded values still equal autograd's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from twin_models import Twin

import gradscope


def _gradscope_hooks(model: nn.Module) -> int:
    """Hooks in the modules' hook dicts, and those a module's carrying class runs (HookSet)."""
    from gradscope.recorder.capture.carrying import is_carrying

    carried = sum(len(type(m)._gradscope_names) - 1 for m in model.modules() if is_carrying(type(m)))
    return carried + sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _reference(model: nn.Module, x: torch.Tensor) -> float:
    """‖∂loss/∂(output of blocks.0)‖ by autograd, on a copy."""
    model = copy.deepcopy(model)
    h = model.blocks[0](x)
    h.retain_grad()
    model.blocks[1](h).square().mean().backward()
    return h.grad.norm().item()


@pytest.mark.parametrize("compiled", [False, True])
def test_hooks_are_there_only_while_a_step_records(compiled):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, xs = Twin(), [torch.randn(2, 3, 8) for _ in range(6)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gradscope.Recorder(model, every=2)
    run = torch.compile(model, fullgraph=True) if compiled else model
    assert _gradscope_hooks(model) == 0  # made, not yet recording
    want = {}
    from torch._dynamo.utils import counters

    for step, x in enumerate(xs):
        if step == 2:
            graphs = counters["stats"]["unique_graphs"]  # both kinds of step compiled once by now
        if rec.records(step):
            want[step] = _reference(model, x)
        with rec.step(step):
            assert (_gradscope_hooks(model) > len(rec.site_names)) == rec.records(step)  # every site's, the root's, the norms'
            run(x).square().mean().backward()
        assert _gradscope_hooks(model) == 0
        opt.step()
        opt.zero_grad()
    if compiled:
        assert counters["stats"]["unique_graphs"] == graphs, "alternating recorded and unrecorded steps recompiled"
    df = rec.frame().query("quantity == 'act_grad_norm' and site == 'blocks.0.out'").set_index("step").value
    assert sorted(df.index) == [0, 2, 4]
    for step, value in want.items():
        assert df[step] == pytest.approx(value, rel=1e-5)
    rec.close()
    assert _gradscope_hooks(model) == 0


def test_a_recorder_dropped_without_close_leaves_no_capture_and_no_hook_behind():
    import gc

    from gradscope.recorder.capture import site_hooks as capture

    model = Twin()
    gc.collect()  # (captures of earlier tests' dropped Recorders, not yet collected)
    before = len(capture._LIVE)
    for step in range(3):
        rec = gradscope.Recorder(model)
        with rec.step(step):
            model(torch.randn(2, 3, 8)).sum().backward()
        del rec
    gc.collect()
    assert len(capture._LIVE) == before  # the registry the hooks read holds no dropped Recorder's capture
    assert _gradscope_hooks(model) == 0
