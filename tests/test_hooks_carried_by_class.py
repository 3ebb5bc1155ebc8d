"""Hooks carried by a module's class while a step records (issue 25, recorder/capture/carrying.py):
a module with only the recorder's tagged hooks gets a carrying class whose ``forward`` runs
them, and its hook dicts stay empty; a module with anyone else's hooks keeps the hook dicts,
so every hook runs in the order the dicts give. References are computed here with autograd
on copies that never had a recorder."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from torch import nn
from twin_models import Twin, TwinBlock

import gradscope
from gradscope.recorder.capture.carrying import is_carrying


def _frame(rec) -> dict:
    df = rec.frame()
    return {(q, s): v for q, s, v in zip(df.quantity, df.site, df.value)}


def _reference(model: Twin, x: torch.Tensor, scale: float = 1.0) -> dict[str, float]:
    """act_norm and act_grad_norm at blocks.0's output (times ``scale``, as a user's hook
    would scale it) and blocks.1's input norm, by autograd on a copy."""
    model = copy.deepcopy(model)
    h0 = model.blocks[0](x) * scale
    h0.retain_grad()
    model.blocks[1](h0).square().mean().backward()
    return {"h0": h0.detach().norm().item(), "h0_grad": h0.grad.norm().item()}


def _record(model: Twin, x: torch.Tensor, during=None):
    rec = gradscope.Recorder(model)
    with rec.step(0):
        if during is not None:
            during(model)
        model(x).square().mean().backward()
    rec.close()
    return _frame(rec)


def test_a_module_with_only_our_hooks_is_carried_and_has_its_class_back():
    torch.manual_seed(0)
    model, x = Twin(), torch.randn(2, 3, 8)
    own = [type(m) for m in model.modules()]
    want = _reference(model, x)
    seen = {}

    def look(m):
        block = m.blocks[0]
        seen.update(carried=is_carrying(type(block)), dicts=len(block._forward_hooks) + len(block._forward_pre_hooks),
                    instance=isinstance(block, TwinBlock), name=type(block).__name__)

    got = _record(model, x, look)
    assert seen == {"carried": True, "dicts": 0, "instance": True, "name": "TwinBlock"}
    assert [type(m) for m in model.modules()] == own
    assert got["act_norm", "blocks.0.out"] == pytest.approx(want["h0"], rel=1e-5)
    assert got["act_grad_norm", "blocks.0.out"] == pytest.approx(want["h0_grad"], rel=1e-5)


@pytest.mark.parametrize("when", ["before", "global"])
def test_a_users_earlier_hook_runs_first_as_the_hook_dicts_order(when):
    """A user's forward hook that doubles blocks.0's output, registered before the Recorder
    (or as a global module hook): the recorder sees the doubled output, as it would in dict
    order, and the module keeps its hook dicts."""
    torch.manual_seed(1)
    model, x = Twin(), torch.randn(2, 3, 8)
    want = _reference(model, x, scale=2.0)
    block = model.blocks[0]

    def double(module, args, output):
        return output * 2 if module is block else None

    handle = block.register_forward_hook(double) if when == "before" else nn.modules.module.register_module_forward_hook(double)
    try:
        seen = {}
        got = _record(model, x, lambda m: seen.update(carried=is_carrying(type(m.blocks[0]))))
    finally:
        handle.remove()
    assert seen == {"carried": False}
    assert got["act_norm", "blocks.0.out"] == pytest.approx(want["h0"], rel=1e-5)
    assert got["act_grad_norm", "blocks.0.out"] == pytest.approx(want["h0_grad"], rel=1e-5)


def test_a_users_hook_added_inside_the_step_sees_the_recorded_output():
    """Registered after the Recorder's hooks (inside the step), a user's hook runs after them
    in either mode: the recorder's numbers are those of the undoubled output."""
    torch.manual_seed(2)
    model, x = Twin(), torch.randn(2, 3, 8)
    want = _reference(model, x)
    handles = []
    got = _record(model, x, lambda m: handles.append(m.blocks[0].register_forward_hook(lambda mod, a, o: o * 2)))
    handles[0].remove()
    assert got["act_norm", "blocks.0.out"] == pytest.approx(want["h0"], rel=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_users_pre_hook_added_between_two_steps_runs_after_ours(compiled):
    """blocks.1 is carried in step 0; a user's pre-hook that doubles its input, registered
    after step 0 (after the recorder's own), must run after the recorder's input hook in
    step 1, as the dicts order them: the module keeps its hook dicts, and blocks.1.in is the
    undoubled value. (Arming skips re-reading the hook dicts of a module it carried only
    while no hook was registered anywhere since.)"""
    torch.manual_seed(4)
    model, x = Twin(), torch.randn(2, 3, 8)
    want = _reference(model, x)
    rec = gradscope.Recorder(model)
    run = torch.compile(model, fullgraph=True) if compiled else model
    seen = []
    for step in range(2):
        if step == 1:
            handle = model.blocks[1].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
        with rec.step(step):
            seen.append(is_carrying(type(model.blocks[1])))
            run(x).square().mean().backward()
    handle.remove()
    rec.close()
    df = rec.frame()
    got = df[(df.quantity == "act_norm") & (df.site == "blocks.1.in")].set_index("step").value
    assert seen == [True, False]
    assert got[0] == pytest.approx(want["h0"], rel=1e-5)
    assert got[1] == pytest.approx(want["h0"], rel=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_users_pre_hook_added_inside_a_step_after_its_forward_runs_after_ours_next_step(compiled):
    """As above, with the user's pre-hook registered *inside* step 0, after its backward,
    while the recorder's eager node hooks of that step were registered too (each takes a
    handle id). Disarming trusts the hook dicts as read for the next arming only if no one
    but the recorder took a handle while armed; here someone did, so step 1 reads them and
    blocks.1 keeps its dicts."""
    torch.manual_seed(5)
    model, x = Twin(), torch.randn(2, 3, 8)
    want = _reference(model, x)
    rec = gradscope.Recorder(model)
    run = torch.compile(model, fullgraph=True) if compiled else model
    seen, handles = [], []
    for step in range(3):
        with rec.step(step):
            seen.append(is_carrying(type(model.blocks[1])))
            run(x).square().mean().backward()
            if step == 0:
                handles.append(model.blocks[1].register_forward_pre_hook(lambda m, args: (args[0] * 2,)))
    handles[0].remove()
    rec.close()
    df = rec.frame()
    got = df[(df.quantity == "act_norm") & (df.site == "blocks.1.in")].set_index("step").value
    assert seen == [True, False, False]
    assert got[1] == pytest.approx(want["h0"], rel=1e-5)
    assert got[2] == pytest.approx(want["h0"], rel=1e-5)


def test_a_module_carried_in_consecutive_eager_steps_is_carried_again_without_its_dicts_read(monkeypatch):
    """With no hook registered by anyone else, a module carried in one eager recorded step
    is carried in the next without its hook dicts being read again, although the step's
    eager node hooks took handle ids (the recorder counts its own)."""
    import gradscope.recorder.capture.hookset as hookset

    torch.manual_seed(6)
    model, x = Twin(), torch.randn(2, 3, 8)
    rec = gradscope.Recorder(model)
    reads, taken = [], []
    real = hookset._no_hooks
    monkeypatch.setattr(hookset, "_no_hooks", lambda state: reads.append(1) or real(state))
    for step in range(3):
        reads.clear()
        with rec.step(step):
            model(x).square().mean().backward()
            taken.append(rec._capture.eager.handles)  # (the node hooks of this step)
        if step == 0:
            first = len(reads)
    rec.close()
    assert min(taken) > 0
    assert first > 0 and reads == []


def _two_armed(seed: int):
    """(model, x, its classes, autograd reference, a, b) with a's step and then b's begun."""
    torch.manual_seed(seed)
    model, x = Twin(), torch.randn(2, 3, 8)
    own, want = [type(m) for m in model.modules()], _reference(model, x)
    a, b = gradscope.Recorder(model), gradscope.Recorder(model)
    a.begin_step(0)
    b.begin_step(0)
    return model, x, own, want, a, b


def test_two_recorders_armed_at_once_carry_once_and_both_equal_autograd():
    model, x, own, want, a, b = _two_armed(3)
    block = model.blocks[0]
    # a's hooks by its carrying class, b's in the dict, under a subclass of a's class (for Dynamo's type guard)
    assert is_carrying(type(block).__base__) and len(block._forward_hooks) == 1
    model(x).square().mean().backward()
    a.end_step()
    assert not is_carrying(type(block)) and type(block) is not TwinBlock  # b still records, in the dicts
    b.end_step()
    assert [type(m) for m in model.modules()] == own
    for rec in (a, b):
        rec.close()
        got = _frame(rec)
        assert got["act_norm", "blocks.0.out"] == pytest.approx(want["h0"], rel=1e-5)
        assert got["act_grad_norm", "blocks.0.out"] == pytest.approx(want["h0_grad"], rel=1e-5)


def test_a_carried_module_copied_or_pickled_inside_the_step_is_a_plain_module():
    torch.manual_seed(4)
    model, x = Twin(), torch.randn(2, 3, 8)
    copies = []

    def keep(m):
        copies.extend([copy.deepcopy(m.blocks[0]), pickle.loads(pickle.dumps(m.blocks[0]))])

    _record(model, x, keep)
    for block in copies:
        assert type(block) is TwinBlock and not block._forward_hooks
        assert torch.equal(block(x), model.blocks[0](x))


def test_a_recorder_dropped_inside_a_step_leaves_a_model_that_computes_and_records_as_before():
    torch.manual_seed(5)
    model, x = Twin(), torch.randn(2, 3, 8)
    want_out, want = model(x), _reference(model, x)
    rec = gradscope.Recorder(model)
    rec.begin_step(0)
    assert any(is_carrying(type(m)) for m in model.modules())
    del rec
    gc.collect()
    assert torch.equal(model(x), want_out)
    got = _record(model, x)
    assert got["act_norm", "blocks.0.out"] == pytest.approx(want["h0"], rel=1e-5)
    assert got["act_grad_norm", "blocks.0.out"] == pytest.approx(want["h0_grad"], rel=1e-5)


def test_a_submodule_compiled_with_module_compile_keeps_its_hook_dicts():
    torch.manual_seed(6)
    model, x = Twin(), torch.randn(2, 3, 8)
    want = _reference(model, x)
    model.blocks[0].ln.compile()
    seen = {}
    got = _record(model, x, lambda m: seen.update(carried=is_carrying(type(m.blocks[0].ln)),
                                                  other=is_carrying(type(m.blocks[1].ln))))
    assert seen == {"carried": False, "other": True}
    assert got["act_norm", "blocks.0.out"] == pytest.approx(want["h0"], rel=1e-5)


def test_a_second_recorders_step_inside_the_first_leaves_the_first_its_carried_hooks():
    """b's step opens and closes inside a's, before the forward: a's hooks, carried by the
    modules' classes, still record (b's disarm only takes out b's own)."""
    model, x, own, want, a, b = _two_armed(7)
    b.abort_step()
    assert is_carrying(type(model.blocks[0]))
    model(x).square().mean().backward()
    a.end_step()
    assert [type(m) for m in model.modules()] == own
    a.close()
    b.close()
    got = _frame(a)
    assert got["act_norm", "blocks.0.out"] == pytest.approx(want["h0"], rel=1e-5)
    assert got["act_grad_norm", "blocks.0.out"] == pytest.approx(want["h0_grad"], rel=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_recorder_dropped_after_its_forward_gives_the_model_back(compiled):
    """A Recorder dropped inside a step after its forward (the graph still holds its taps):
    once it is collected its hooks are disarmed, every module has its own class and empty
    hook dicts, backward runs, and a new Recorder records as before (compiled too, where the
    modules left armed made its first step fail)."""
    torch.manual_seed(8)
    model, x = Twin(), torch.randn(2, 3, 8)
    own = [type(m) for m in model.modules()]
    want = _reference(model, x)
    run = torch.compile(model, fullgraph=True) if compiled else model
    rec = gradscope.Recorder(model)
    with rec.step(0):
        run(x).square().mean().backward()
    rec.begin_step(1)
    loss = run(x).square().mean()
    del rec
    gc.collect()
    loss.backward()
    del loss
    gc.collect()
    assert [type(m) for m in model.modules()] == own
    assert not any(d for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks))
    model.zero_grad(set_to_none=True)
    rec = gradscope.Recorder(model)
    with rec.step(2):
        run(x).square().mean().backward()
    rec.close()
    got = _frame(rec)
    assert got["act_norm", "blocks.0.out"] == pytest.approx(want["h0"], rel=1e-5)
    assert got["act_grad_norm", "blocks.0.out"] == pytest.approx(want["h0_grad"], rel=1e-5)


def test_a_second_recorder_wrapping_the_first_backward_records_every_step_compiled():
    """b's step wraps the first of a's two micro-steps, compiled: the graph traced for a
    alone must not run while b's hooks sit in the dicts of modules that a's classes carry
    (Dynamo guards a module's class, not its hook dicts), so b has its gradient rows at
    every step, equal to autograd's, and so has a."""
    torch.manual_seed(6)
    model, x = Twin(), torch.randn(2, 3, 8)
    own = [type(m) for m in model.modules()]
    want = _reference(model, x)
    a, b = gradscope.Recorder(model), gradscope.Recorder(model)
    run = torch.compile(model, fullgraph=True)
    for step in range(3):
        with a.step(step):
            with b.step(step):
                run(x).square().mean().backward()
            run(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
    assert [type(m) for m in model.modules()] == own
    for rec, first in ((a, 0), (b, -1)):  # (a's first micro-step; b's step has one)
        rec.close()
        df = rec.frame(micro_steps=True)
        rows = df[(df.quantity == "act_grad_norm") & (df.site == "blocks.0.out") & (df.micro_step == first)]
        assert sorted(rows.step) == [0, 1, 2]
        assert rows.value.tolist() == pytest.approx([want["h0_grad"]] * 3, rel=1e-5)
