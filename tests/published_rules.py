"""The foreign-model site rules, derived here from ``named_modules()``, and the autograd
references the recorder is checked against (tests/test_recorder_published.py).

Expected sites come from the foreign-model rules, derived here from ``named_modules()``:

- repeated blocks: an ``nn.ModuleList``/``nn.Sequential`` at path P whose >= 2 children are all
  of one class and hold parameters (not inside another such list); sites ``P.i.in`` / ``P.i.out``.
  When the children are containers (x-transformers' ``ModuleList([norms, block, residual])``)
  the block is the non-container child holding parameters (``P.i.1``).
- norms: ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``, batch norms, or a leaf module whose
  class name ends in ``Norm`` with only <= 1-D parameters; parametrizations (weight norm's
  ``_WeightNorm``) are not activation norms. Sites ``N.in`` (gradient through the norm alone)
  and ``N.out`` (total gradient).
- the k-th call (k >= 2) of a module in one forward gets ``#k`` appended.

References are plain autograd on tensors captured by hooks written here; parameter norms come
from ``torch.autograd.grad`` w.r.t. the parameters.
"""

from __future__ import annotations

import collections
import functools
import math

import pytest
import torch
from torch import nn

import gradscope
from recorder_ref import _first
from published_models import MODELS, VALUE_QUANTITIES, LayerNorm

transformers = pytest.importorskip("transformers")


# -- the site rules, derived from named_modules() --------------------------------------------------
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def holds_params(m):
    return m is not None and any(True for _ in m.parameters())


_TORCH_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


def _gain_wrapper(m: nn.Module) -> bool:
    """A *Norm class holding one parameter-free torch norm and its own gain (x-transformers' LayerNorm)."""
    kids = list(m.children())
    return (type(m).__name__.endswith("Norm") and len(kids) == 1 and isinstance(kids[0], _TORCH_NORMS)
            and not list(kids[0].parameters()))


def is_norm(name: str, m: nn.Module) -> bool:
    if ".parametrizations." in f".{name}.":
        return False  # torch.nn.utils.parametrizations.weight_norm's _WeightNorm: not an activation norm
    if isinstance(m, _TORCH_NORMS):
        return True
    return (type(m).__name__.endswith("Norm") and (not list(m.children()) or _gain_wrapper(m))
            and all(prm.dim() <= 1 for prm in m.parameters(recurse=False)))


def norm_modules(model) -> dict[str, nn.Module]:
    found = {n: m for n, m in model.named_modules() if is_norm(n, m)}
    return {n: m for n, m in found.items() if not (n.rpartition(".")[0] in found and _gain_wrapper(found[n.rpartition(".")[0]]))}


def _block_lists(model) -> list[tuple[str, list[nn.Module]]]:
    lists = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or any(name.startswith(f"{p}.") for p, _ in lists):
            continue
        kids = list(m._modules.values())
        if len(kids) >= 2 and all(holds_params(k) for k in kids) and len({type(k) for k in kids}) == 1:
            lists.append((name, kids))
    return lists


def block_modules(model) -> dict[str, nn.Module]:
    blocks = {}
    for name, kids in _block_lists(model):
        for i, kid in enumerate(kids):
            if isinstance(kid, _CONTAINERS):
                inner = [(c, sub) for c, sub in kid.named_children() if holds_params(sub) and not isinstance(sub, _CONTAINERS)]
                assert len(inner) == 1, f"{name}.{i}: no single block inside {[c for c, _ in inner]}"
                blocks[f"{name}.{i}.{inner[0][0]}"] = inner[0][1]
            else:
                blocks[f"{name}.{i}"] = kid
    return blocks


def build(name, p=0.0, perturb=False):
    """Model ``name`` seeded (dropout ``p``) in train mode; ``perturb``: its norms' parameters moved."""
    torch.manual_seed(0)
    model, run = MODELS[name][0](p)
    model.train()
    if perturb:  # norm gains away from 1 (Gemma's start at 0), so w/σ and ln_gain see them
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for _, m in norm_modules(model).items():
                for prm in m.parameters():
                    prm.add_(0.3 * torch.randn(prm.shape, generator=g))
    return model, run


# -- references -----------------------------------------------------------------------------------
_first_tensor = _first  # a module output's main tensor (recorder_ref)


def _main_input(args, kwargs):
    """(tensor, rebuild): the first positional floating tensor, else the first floating tensor kwarg."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a, lambda v, i=i: ((*args[:i], v, *args[i + 1:]), kwargs)
    for k, a in kwargs.items():
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a, lambda v, k=k: (args, {**kwargs, k: v})
    return None, None


def reference(model, run, targets: dict[str, nn.Module], norms: set[str]):
    """Runs ``run()`` once with hooks on ``targets``; site ``{name}.in|out`` (``#k`` for call k >= 2).

    A norm's input is replaced by a view, so its gradient is the one through the norm alone.

    Returns:
        (site -> ‖∂loss/∂site‖ or None when the site's tensor does not require grad,
         site -> detached forward value)
    """
    captured, calls, handles = {}, collections.Counter(), []

    def sfx(name):
        return "" if calls[name] == 1 else f"#{calls[name]}"

    for name, module in targets.items():
        def pre(mod, args, kwargs, name=name):
            calls[name] += 1
            x, rebuild = _main_input(args, kwargs)
            if x is None:
                return None
            if name in norms:
                x = x.view_as(x)
                captured[f"{name}.in{sfx(name)}"] = x
                return rebuild(x)
            captured[f"{name}.in{sfx(name)}"] = x
            return None

        def post(mod, args, out, name=name):
            t = _first_tensor(out)
            if t is not None:
                captured[f"{name}.out{sfx(name)}"] = t

        handles += [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post)]
    try:
        loss = run()
        names = [n for n, t in captured.items() if t.requires_grad]
        grads = torch.autograd.grad(loss, [captured[n] for n in names], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    norm_of = {n: (0.0 if g is None else g.norm().item()) for n, g in zip(names, grads)}
    return {n: norm_of.get(n) for n in captured}, {n: t.detach() for n, t in captured.items()}


def param_grad_reference(model, run, groups: list[str]) -> dict[str, float]:
    """group (a module or parameter name, "" = whole model) -> sqrt(Σ ‖∂loss/∂p‖²) over that module's unique parameters."""
    params = [q for q in model.parameters() if q.requires_grad]  # unique parameters (tied ones once)
    grads = dict(zip(map(id, params), torch.autograd.grad(run(), params, allow_unused=True)))
    out = {}
    named = dict(model.named_parameters())
    for g in groups:  # a group names a module, or one parameter (a module's own, beside its children's groups)
        sub = [named[g]] if g in named else (model if g == "" else model.get_submodule(g)).parameters()
        out[g] = math.sqrt(sum(grads[id(q)].double().norm().item() ** 2 for q in sub if grads.get(id(q)) is not None))
    return out


def w_over_sigma_reference(module: nn.Module, x: torch.Tensor) -> float | None:
    """mean over tokens and features of g_f/σ_t, computed from the norm's input; None for other norms."""
    x = x.double()
    cls = type(module).__name__
    if isinstance(module, (nn.LayerNorm, LayerNorm)):
        nd = len(module.normalized_shape) if isinstance(module, nn.LayerNorm) else 1
        sigma = torch.sqrt(x.var(dim=tuple(range(-nd, 0)), unbiased=False) + getattr(module, "eps", 1e-5))
        gain = module.weight if module.weight is not None else torch.ones(x.shape[-nd:])
    elif cls in ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "T5LayerNorm"):
        sigma, gain = torch.sqrt(x.pow(2).mean(-1) + module.variance_epsilon), module.weight
    elif cls == "GemmaRMSNorm":
        sigma, gain = torch.sqrt(x.pow(2).mean(-1) + module.eps), 1.0 + module.weight
    else:
        return None
    return (gain.detach().double().reshape(1, -1) / sigma.reshape(-1, 1)).mean().item()


def module_of(site: str) -> tuple[str, str, int]:
    """'a.b.out#2' -> ('a.b', 'out', 2)."""
    base, _, k = site.partition("#")
    name, _, where = base.rpartition(".")
    return name, where, int(k) if k else 1


# -- one recorded step per model, shared by the value tests ----------------------------------------
@functools.lru_cache(maxsize=None)
def recorded(name):
    model, run = build(name, perturb=True)
    with gradscope.record(model, quantities=VALUE_QUANTITIES) as rec:
        run().backward()
    df = rec.frame()
    model.zero_grad(set_to_none=True)
    return model, run, df[df.micro_step == -1]


@functools.lru_cache(maxsize=None)
def expected(name):
    """Reference on a fresh model (same seed): blocks, norms, site gradients and values."""
    model, run = build(name, perturb=True)
    blocks, norms = block_modules(model), norm_modules(model)
    grads, values = reference(model, run, {**blocks, **norms}, set(norms))
    return model, run, blocks, norms, grads, values


def rows_by_site(df, quantity):
    rows = df[df.quantity == quantity]
    assert not rows.site.duplicated().any(), f"{quantity}: duplicated sites {rows.site[rows.site.duplicated()].tolist()}"
    return dict(zip(rows.site, rows.value))

