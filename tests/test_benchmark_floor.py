"""The benchmark's floor (``benchmarks.overhead_methods.bare_site_norms``) and simple references take what they say:
one squared norm per distinct site value and one per its gradient, every step.

It once kept only the ids of the values it had seen, and a freed tensor's id is reused by
the next tensor made, so it took a third fewer norms than that on the 6+6 model and the
floor the recorder was compared against was too low (benchmarks/RESULTS.md). The count
here comes from hooks that hold every value they see.
"""

from __future__ import annotations

import pytest
import torch

import gradscope
from benchmarks import overhead_methods


def _site_values(model: torch.nn.Module, batch: tuple) -> list[torch.Tensor]:
    """The value each site call received, in order (held, so no id is reused while counting)."""
    values: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda module, args, value: values.append(value))
               for m in model.modules() if isinstance(m, gradscope.Site)]
    with torch.no_grad():
        overhead_methods.loss_of(model, batch)
    for h in handles:
        h.remove()
    return values


def _distinct_site_values(model: torch.nn.Module, batch: tuple) -> int:
    return len({id(v) for v in _site_values(model, batch)})


@pytest.mark.parametrize("with_params", [False, True])
def test_the_floor_takes_one_norm_per_distinct_site_value_and_gradient(monkeypatch, with_params):
    model = overhead_methods.make_model(4, 16, "cpu")
    batch = overhead_methods.make_batch(2, 5, "cpu")
    want = _distinct_site_values(model, batch)
    taken = []
    real = overhead_methods.squared_norm
    monkeypatch.setattr(overhead_methods, "squared_norm", lambda t: taken.append(1) or real(t))
    runner = overhead_methods.bare_site_norms(with_params)(model, overhead_methods.make_optimizer(model), batch, False)
    for step in range(3):
        taken.clear()
        runner.step(step)
        assert len(taken) == 2 * want, f"step {step}"
    assert want > 20


@pytest.mark.parametrize("own_gradients", [False, True])
def test_the_simple_references_norm_every_site_value_its_gradient_and_every_parameter(monkeypatch, own_gradients):
    """The simple references ``simple_site_hooks`` and ``simple_param_norms`` reduce what they say,
    and the tensors are autograd's: every distinct site value (or, each site with its own
    gradient, an alias per site call), its kept gradient and every parameter's gradient (a
    reference that skipped work would make the recorder look worse than it is)."""
    model = overhead_methods.make_model(4, 16, "cpu")
    batch = overhead_methods.make_batch(2, 5, "cpu")
    want = len(_site_values(model, batch)) if own_gradients else _distinct_site_values(model, batch)
    params = list(model.parameters())
    lists: list[list[torch.Tensor]] = []
    real = overhead_methods.fp64_squared_norms
    monkeypatch.setattr(overhead_methods, "fp64_squared_norms", lambda ts: lists.append(list(ts)) or real(ts))
    runner = overhead_methods.simple_site_hooks(own_gradients)(model, overhead_methods.make_optimizer(model), batch,
                                                              False)
    for step in range(2):
        lists.clear()
        runner.step(step)
        values, grads_of_params, grads = lists
        assert len(values) == want > 20, f"step {step}"
        assert len(grads) == want  # (every site value of the zoo model is made by autograd and feeds the loss)
        assert all(g is v.grad for g, v in zip(grads, values))
        assert [g.shape for g in grads_of_params] == [p.shape for p in params]  # (p.grad is None again after the step)
    twin = overhead_methods.make_model(4, 16, "cpu")
    runner = overhead_methods.simple_param_norms(twin, overhead_methods.make_optimizer(twin), batch, False)
    lists.clear()
    runner.step(0)
    assert len(lists) == 1 and len(lists[0]) == len(params)
