"""Slow references for the recorder tests, written independently of gradscope.recorder.

A site is a module boundary. The gradient at a site is ``torch.autograd.grad`` of the loss
w.r.t. the value that crosses it: a view inserted where the module passes its output on
(everything downstream of the module's output) or in front of the module's input (the
gradient flowing back through that module alone). ``isolate=False`` instead retains the
tensor itself, all of its uses summed."""

from __future__ import annotations

import math

import torch


def _swap_first(value, new):
    if isinstance(value, torch.Tensor):
        return new
    return type(value)([new, *value[1:]])


def _first(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def site_gradients(model, modules: dict[str, tuple[torch.nn.Module, str]], run, isolate: bool = True) -> tuple[dict, dict]:
    """Runs ``run()`` (returns the loss) with views retained at each site.

    Args:
        modules: site name -> (module, "output" | "input").

    Returns:
        (site -> ‖∂loss/∂site‖₂ via autograd.grad, site -> retained forward value).
    """
    captured: dict[str, torch.Tensor] = {}
    handles = []
    for name, (module, where) in modules.items():
        if where == "output":
            def hook(mod, args, out, name=name):
                t = _first(out)
                if t is None or name in captured:
                    return None
                captured[name] = t.view_as(t) if isolate else t
                return _swap_first(out, captured[name]) if isolate else None
            handles.append(module.register_forward_hook(hook))
        else:
            def pre(mod, args, kwargs, name=name):
                if name in captured:
                    return None
                if args and isinstance(args[0], torch.Tensor):
                    view = args[0].view_as(args[0]) if isolate else args[0]
                    captured[name] = view
                    return ((view, *args[1:]), kwargs) if isolate else None
                view = kwargs["hidden_states"].view_as(kwargs["hidden_states"]) if isolate else kwargs["hidden_states"]
                captured[name] = view
                return (args, {**kwargs, "hidden_states": view}) if isolate else None
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        loss = run()
        names = [n for n in captured if captured[n].requires_grad]
        grads = torch.autograd.grad(loss, [captured[n] for n in names], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    norms = {n: (g.double().norm().item() if g is not None else 0.0) for n, g in zip(names, grads)}  # (fp64: a bf16 norm rounds)
    return norms, {n: t.detach() for n, t in captured.items()}


def assert_rel(actual: float, expected: float, rel: float = 1e-5, what: str = "") -> None:
    assert math.isclose(actual, expected, rel_tol=rel, abs_tol=1e-12), f"{what}: {actual} vs {expected}"


def all_hook_dicts_empty(model: torch.nn.Module) -> list[str]:
    """Names of modules with any hook left (forward, pre-forward, backward, state-dict hooks aside)."""
    attrs = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")
    bad = []
    for name, m in model.named_modules():
        for attr in attrs:
            if getattr(m, attr, None):
                bad.append(f"{name or '<root>'}.{attr}")
    return bad


def norm_gains(model, norms: dict[str, torch.nn.Module], run) -> dict[str, float]:
    """name -> ‖grad through the norm alone at its input‖ / ‖∂loss/∂(norm output)‖."""
    g_in, _ = site_gradients(model, {n: (m, "input") for n, m in norms.items()}, run)
    g_out, _ = site_gradients(model, {n: (m, "output") for n, m in norms.items()}, run)
    return {n: g_in[n] / g_out[n] for n in norms}
