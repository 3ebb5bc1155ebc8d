"""Models and helpers shared by the failure-class tests (tests/test_recorder_failures*.py):
a reference computed with our own hooks (``tap``), gradient norms from ``p.grad``, and two
small chains of blocks."""

from __future__ import annotations

import math

import torch
from torch import nn

from recorder_ref import _first

D = 16  # feature width of every model here
B, T = 2, 5


def values_by_site(df, quantity, micro=-1):
    rows = df[(df.quantity == quantity) & (df.micro_step == micro)]
    return dict(zip(rows.site, rows.value))


def inputs(seed=0, shape=(B, T, D)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


_first_tensor = _first  # a module output's main tensor (recorder_ref)


def _main_input(args, kwargs):
    """First positional tensor, else the first floating-point tensor keyword argument."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return next(v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.is_floating_point())


def _replace_main_input(args, kwargs, new):
    if args and isinstance(args[0], torch.Tensor):
        return (new, *args[1:]), kwargs
    key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_floating_point())
    return args, {**kwargs, key: new}


def tap(run, taps: dict[str, tuple[nn.Module, str]]):
    """Runs ``run()`` (returns the loss) with our own hooks; every call of a tapped module is
    captured (call k >= 2 under ``name#k``).

    kinds: "in" (the module's main input, total gradient), "in_iso" (a view inserted in
    front of the module: gradient through the module alone), "out" (first tensor of the
    output), "out_clone" (the output is captured and a clone passed on, so later in-place
    ops of the model act on the clone, not on the captured tensor).

    Returns (name -> ‖∂loss/∂t‖, name -> ‖t‖ at capture time, name -> t detached).
    """
    captured: dict[str, torch.Tensor] = {}
    act: dict[str, float] = {}
    counts: dict[str, int] = {}
    handles = []

    def keep(name, t):
        counts[name] = counts.get(name, 0) + 1
        key = name if counts[name] == 1 else f"{name}#{counts[name]}"
        captured[key] = t
        act[key] = t.detach().double().norm().item()

    for name, (module, kind) in taps.items():
        if kind in ("in", "in_iso"):
            def pre(mod, args, kwargs, name=name, kind=kind):
                x = _main_input(args, kwargs)
                if kind == "in":
                    keep(name, x)
                    return None
                view = x.view_as(x)
                keep(name, view)
                return _replace_main_input(args, kwargs, view)
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        else:
            def post(mod, args, out, name=name, kind=kind):
                t = _first_tensor(out)
                keep(name, t)
                if kind == "out_clone":
                    return t.clone()
                return None
            handles.append(module.register_forward_hook(post))
    try:
        loss = run()
        names = [n for n, t in captured.items() if t.requires_grad]
        grads = torch.autograd.grad(loss, [captured[n] for n in names], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    gnorm = {n: (g.double().norm().item() if g is not None else 0.0) for n, g in zip(names, grads)}
    return gnorm, act, {n: t.detach() for n, t in captured.items()}


def grad_norm_of(params) -> float:
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params if p.grad is not None))


class MLPBlock(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Chain(nn.Module):
    """inp -> the blocks in order (an nn.ModuleList named ``attr``) -> head."""

    def __init__(self, blocks, attr: str = "blocks"):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.attr = attr
        setattr(self, attr, nn.ModuleList(blocks))
        self.head = nn.Linear(D, D)

    def forward(self, x):
        h = self.inp(x)
        for blk in getattr(self, self.attr):
            h = blk(h)
        return self.head(h)

