"""The recorder on published architectures, built tiny with random weights (nothing downloaded):
a nanoGPT written for the tests, x-transformers, HuggingFace models from their config classes
and ``torch.nn.Transformer``.

Expected sites come from the foreign-model rules (repeated blocks, norms, the k-th call of a
module), derived from ``named_modules()`` in tests/published_rules.py, which also holds the
references: plain autograd on tensors captured by hooks written there, and
``torch.autograd.grad`` w.r.t. the parameters. The models are in tests/published_models.py.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import gradscope
from recorder_ref import all_hook_dicts_empty, assert_rel, norm_gains
from published_models import MODELS, NAMES
from published_rules import (block_modules, build, expected, holds_params, module_of, norm_modules, param_grad_reference,
                             recorded, reference, rows_by_site, w_over_sigma_reference)


# -- tests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_rules_derive_the_expected_layout(name):
    """Self-check of this file's rule derivation (no recorder involved)."""
    model, _ = build(name)
    assert list(block_modules(model)) == MODELS[name][1]
    norms = norm_modules(model)
    assert norms and {type(m).__name__ for m in norms.values()} == MODELS[name][2]


@pytest.mark.parametrize("name", NAMES)
def test_act_grad_norm_at_every_site_equals_autograd(name):
    model, run, blocks, norms, ref, values = expected(name)
    _, _, df = recorded(name)
    got, act = rows_by_site(df, "act_grad_norm"), rows_by_site(df, "act_norm")
    # the blocks and norms the rules name are all reported (a site whose tensor needs no grad may lack a gradient)
    for b in blocks:
        for where in ("in", "out"):
            site = f"{b}.{where}"
            assert site in act, f"block site {site} missing; reported: {sorted(act)[:12]}"
            assert ref.get(site) is None or site in got, f"no act_grad_norm at {site}"
    for n in norms:
        lacking = [f"{n}.{w}" for w in ("in", "out") if f"{n}.{w}" not in got]
        assert not lacking, f"norm sites missing: {lacking}"
    missing = [s for s, v in ref.items() if v is not None and v > 0 and s not in got]
    assert not missing, f"reference sites not reported: {missing}"
    # every reported .in/.out site (expected or not) equals autograd at the same place
    sites = [s for s in got if module_of(s)[1] in ("in", "out")]
    extra = {m for m, where, _ in map(module_of, [*got, *act]) if where in ("in", "out") and m not in blocks and m not in norms}
    if extra:
        modules = dict(model.named_modules())
        unknown = sorted(m for m in extra if m not in modules)
        assert not unknown, f"sites on no module: {unknown}"
        ref_x, values_x = reference(model, run, {m: modules[m] for m in extra}, set())
        ref, values = {**ref_x, **ref}, {**values_x, **values}
    for site in sites:
        expected_grad = ref.get(site)
        assert site in values, f"{site}: the module was not called with a tensor there"
        if expected_grad is None:
            assert got[site] == 0.0, f"{site}: no gradient reaches it, recorder says {got[site]}"
        else:
            assert_rel(got[site], expected_grad, what=f"act_grad_norm {site}")
    for site, value in act.items():
        if module_of(site)[1] in ("in", "out"):
            assert site in values, f"{site}: the module was not called with a tensor there"
            assert_rel(value, values[site].double().norm().item(), what=f"act_norm {site}")


def _sublayers(prefix: str, module) -> list[str]:
    """The sub-layer groups the docs promise (docs/table.md): the children that hold
    parameters; a list's entries instead of the list; a lone child's children instead of it
    (its group would be the block's) unless all its parameters are its own."""
    kids = [(c, sub) for c, sub in module.named_children() if holds_params(sub)]
    if len(kids) == 1 and not list(module.parameters(recurse=False)) and not isinstance(kids[0][1], torch.nn.ModuleList):
        c, sub = kids[0]
        own_only = not any(holds_params(s) for s in sub.children())
        return [] if own_only else _sublayers(f"{prefix}.{c}", sub)
    out = []
    for c, sub in kids:
        if isinstance(sub, torch.nn.ModuleList):
            out += [f"{prefix}.{c}.{k}" for k, entry in sub.named_children() if holds_params(entry)]
        else:
            out.append(f"{prefix}.{c}")
    return out


@pytest.mark.parametrize("name", NAMES)
def test_param_grad_norm_total_and_per_block(name):
    model, run, df = recorded(name)
    got = rows_by_site(df, "param_grad_norm")
    required = [""]
    for b, block in block_modules(model).items():  # the block whose sites are b.in / b.out, and its sub-layers
        required += [b] + _sublayers(b, block)
    missing = [g for g in required if g not in got]
    assert not missing, f"param_grad_norm groups missing: {missing}; reported {sorted(got)[:10]}"
    modules, params = dict(model.named_modules()), dict(model.named_parameters())
    unknown = [g for g in got if g not in modules and g not in params]  # a module's own parameters beside its
    assert not unknown, f"groups that name no module or parameter: {unknown}"  # children's groups: one group each
    ref = param_grad_reference(model, run, list(got))
    for group, value in got.items():
        assert_rel(value, ref[group], what=f"param_grad_norm {group!r}")


@pytest.mark.parametrize("name", NAMES)
def test_site_roles(name):
    _, _, blocks, norms, _, _ = expected(name)
    _, _, df = recorded(name)
    assert "role" in df.columns, "the table has no role column"
    rows = df[df.quantity == "act_norm"]
    role = dict(zip(rows.site, rows.role))
    # a norm outside the blocks whose parameter group is the model's final norm is named so at its sites too
    groups = df[df.quantity == "param_grad_norm"]
    final = set(groups.loc[groups.role == "final_norm", "site"])
    kind = {n: "final_norm" if n in final else "norm" for n in norms}
    want = {**{f"{b}.in": "layer_in" for b in blocks}, **{f"{b}.out": "layer_out" for b in blocks},
            **{f"{n}.in": f"{kind[n]}_in" for n in norms}, **{f"{n}.out": f"{kind[n]}_out" for n in norms}}
    for site, r in role.items():
        base = site.partition("#")[0]
        if base in want:
            assert r == want[base], f"{site}: role {r!r}, expected {want[base]!r}"
    assert set(want) <= set(role), f"sites without rows: {sorted(set(want) - set(role))}"


def _per_call(norm: str, got: dict, per_call: dict[int, float], aggregate: float, quantity: str) -> None:
    """Rows ``N``, ``N#2``... per call, or (repeatedly called norm) one ``N`` row for all calls."""
    if any(f"{norm}#{k}" in got for k in per_call if k > 1) or len(per_call) == 1:
        for k, want in per_call.items():
            site = norm if k == 1 else f"{norm}#{k}"
            assert site in got, f"{quantity}: no row for {site}"
            assert_rel(got[site], want, what=f"{quantity} {site}")
    else:
        assert norm in got, f"{quantity}: no row for {norm}"
        assert_rel(got[norm], aggregate, what=f"{quantity} {norm} (all {len(per_call)} calls)")


@pytest.mark.parametrize("name", NAMES)
def test_ln_gain_and_w_over_sigma(name):
    model, run, _, norms, ref, values = expected(name)
    # self-check of the reference: first-call gains agree with recorder_ref.norm_gains
    for n, g in norm_gains(model, norms, run).items():
        assert_rel(ref[f"{n}.in"] / ref[f"{n}.out"], g, what=f"reference gain {n}")
    _, _, df = recorded(name)
    gains, wsig = rows_by_site(df, "ln_gain"), rows_by_site(df, "ln_w_over_sigma")
    gain_at = {s.partition("#")[0] for s in gains}
    assert gain_at == set(norms), f"ln_gain rows: missing {sorted(set(norms) - gain_at)}, not norms {sorted(gain_at - set(norms))}"
    not_norms = sorted({s.partition("#")[0] for s in wsig} - set(norms))
    assert not not_norms, f"ln_w_over_sigma rows on modules that are not norms: {not_norms}"
    for n, module in norms.items():
        ks = sorted(module_of(s)[2] for s in values if module_of(s)[:2] == (n, "in"))
        sites = {k: ("" if k == 1 else f"#{k}") for k in ks}
        g_in = {k: ref[f"{n}.in{s}"] for k, s in sites.items()}
        g_out = {k: ref[f"{n}.out{s}"] for k, s in sites.items()}
        _per_call(n, gains, {k: g_in[k] / g_out[k] for k in ks},
                  math.sqrt(sum(v * v for v in g_in.values())) / math.sqrt(sum(v * v for v in g_out.values())), "ln_gain")
        w = {k: w_over_sigma_reference(module, values[f"{n}.in{s}"]) for k, s in sites.items()}
        if None not in w.values():
            _per_call(n, wsig, w, sum(w.values()) / len(w), "ln_w_over_sigma")


def _train(name, record):
    model, run = build(name, p=0.1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec = gradscope.Recorder(model, quantities="all", optimizer=opt) if record else None
    losses = []
    for step in range(3):
        with rec.step(step) if rec is not None else contextlib.nullcontext():
            loss = run()
            loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    rng = torch.get_rng_state()
    df = None
    if rec is not None:
        df = rec.frame()
        rec.close()
    return model, losses, rng, df


@pytest.mark.parametrize("name", NAMES)
def test_training_bit_identical_with_dropout(name):
    plain, plain_losses, plain_rng, _ = _train(name, record=False)
    rec_model, rec_losses, rec_rng, df = _train(name, record=True)
    assert set(df.step) == {0, 1, 2} and (df.quantity == "act_grad_norm").any()
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, rec_losses)), f"losses {plain_losses} vs {rec_losses}"
    for (n, p), (_, q) in zip(plain.named_parameters(), rec_model.named_parameters()):
        assert torch.equal(p, q), f"parameter {n} differs"
    for (n, b), (_, c) in zip(plain.named_buffers(), rec_model.named_buffers()):
        assert torch.equal(b, c), f"buffer {n} differs"
    assert torch.equal(plain_rng, rec_rng), "the recorder changed the global RNG state"


@pytest.mark.parametrize("name", NAMES)
def test_close_removes_every_hook(name):
    from torch.nn.modules import module as module_mod

    global_dicts = [getattr(module_mod, a) for a in dir(module_mod) if a.startswith("_global_") and a.endswith("hooks")
                    and isinstance(getattr(module_mod, a), dict)]
    before = [len(d) for d in global_dicts]
    model, run = build(name, p=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rec = gradscope.Recorder(model, quantities="all", optimizer=opt)
    with rec.step(0):
        run().backward()
    opt.step()
    rec.close()
    assert all_hook_dicts_empty(model) == []
    assert [len(d) for d in global_dicts] == before, "global module hooks left"
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks, "optimizer hooks left"

