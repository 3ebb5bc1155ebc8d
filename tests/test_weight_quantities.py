"""The "weights" set (issue 52): param_norm, param_rms, update_rms, adam_v_sqrt_mean/max,
spectral_norm and stable_rank, against references computed here from the parameters, the
optimizer's own state and torch.linalg, on models nobody here wrote (HF GPT-2, Llama, BERT
from config, torch.nn.TransformerEncoder, a nanoGPT-style model written in the test),
eagerly and under torch.compile.

A parameter group's members are the parameters whose names start with the group's name
(site ``""``: all), which is what the group's name says (tests/test_param_groups_mean_their_names.py).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import gradscope
from gradscope.recorder.quantities.weights import SpectralNorm
from tests.stats_models import MODELS, VOCAB, build, loss_of

WEIGHTS = ["param_norm", "param_rms", "update_rms", "adam_v_sqrt_mean", "adam_v_sqrt_max", "spectral_norm", "stable_rank"]


def _members(model, group: str) -> list[str]:
    return [n for n, _ in model.named_parameters() if group == "" or n == group or n.startswith(group + ".")]


def _cat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().double().flatten() for t in tensors])


CASES = [(k, False) for k in MODELS] + [(k, True) for k in ("nanogpt", "encoder", "gpt2")]


@pytest.mark.parametrize("kind,compiled", CASES, ids=[f"{k}-{'compiled' if c else 'eager'}" for k, c in CASES])
def test_weight_statistics_match_the_parameters_and_the_optimizer_state(kind, compiled):
    torch.manual_seed(0)
    model = build(kind, layers=1 if compiled else 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = gradscope.Recorder(model, quantities=WEIGHTS, optimizer=opt, slow_every=1)
    run = torch.compile(model, fullgraph=True) if compiled else model
    g = torch.Generator().manual_seed(1)
    named = dict(model.named_parameters())
    expected = []  # (step, quantity, site, value)
    for step in range(3):
        before = {n: p.detach().clone() for n, p in named.items()}
        with rec.step(step):
            loss_of(run, torch.randint(0, VOCAB, (2, 6), generator=g)).backward()
        v = {n: opt.state[p]["exp_avg_sq"].clone() for n, p in named.items() if "exp_avg_sq" in opt.state.get(p, {})}
        opt.step()
        opt.zero_grad()
        for group in {k.site for k in rec.groups.keys("param_norm")}:
            members = _members(model, group)
            if not members:
                continue
            theta = _cat(before[n] for n in members)
            delta = _cat(named[n] - before[n] for n in members)
            expected += [(step, "param_norm", group, theta.norm().item()),
                         (step, "param_rms", group, theta.norm().item() / math.sqrt(theta.numel())),
                         (step, "update_rms", group, delta.norm().item() / math.sqrt(delta.numel()))]
            if v:  # (the state the previous optimizer.step() left: none at step 0)
                roots = _cat(v[n] for n in members).sqrt()
                expected += [(step, "adam_v_sqrt_mean", group, roots.mean().item()),
                             (step, "adam_v_sqrt_max", group, roots.max().item())]
    rec.close()
    df = rec.frame()
    got = df.set_index(["step", "quantity", "site"]).value
    for step, quantity, site, value in expected:
        # fp32 on the device (squared norms in float64 then fp32; √v summed in fp32) against float64 here
        assert got[(step, quantity, site)] == pytest.approx(value, rel=1e-5, abs=1e-12), (step, quantity, site)
    for quantity in ("param_norm", "update_rms", "adam_v_sqrt_mean"):  # nothing more than the expected rows
        assert len(df[df.quantity == quantity]) == sum(1 for e in expected if e[1] == quantity), quantity
    assert not len(df[(df.quantity == "adam_v_sqrt_mean") & (df.step == 0)])
    # spectral: one row per 2-D parameter, a lower bound of ‖W‖₂ (the converged value is tested below), and the
    # stable rank is ‖W‖_F² over that estimate squared
    matrices = {n for n, p in named.items() if p.dim() == 2}
    for step in range(3):
        sigma = df[(df.quantity == "spectral_norm") & (df.step == step)].set_index("site").value
        rank = df[(df.quantity == "stable_rank") & (df.step == step)].set_index("site").value
        assert set(sigma.index) == matrices == set(rank.index)
    last = df[df.step == 2]
    for n in matrices:
        s = last[(last.quantity == "spectral_norm") & (last.site == n)].value.item()
        r = last[(last.quantity == "stable_rank") & (last.site == n)].value.item()
        assert s > 0 and r >= 1 - 1e-5


def _frozen_run(kind: str, steps: int, slow_every: int):
    torch.manual_seed(0)
    model = build(kind)
    rec = gradscope.Recorder(model, quantities=["spectral_norm", "stable_rank"], slow_every=slow_every)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        with rec.step(step):
            loss_of(model, torch.randint(0, VOCAB, (2, 6), generator=g)).backward()
        model.zero_grad()
    rec.close()
    return model, rec.frame()


@pytest.mark.parametrize("kind", MODELS)
def test_power_iteration_keeps_its_vectors_and_converges_to_the_matrix_norm(kind, monkeypatch):
    # 50 iterations per slow step (4 by default), so that 30 slow steps make 1500: these random matrices' top
    # two singular values lie close (σ₂/σ₁ up to 0.996 in nanoGPT's h.1.mlp.2), where 120 iterations leave 4e-3
    monkeypatch.setattr(SpectralNorm, "iterations", 50)
    model, df = _frozen_run(kind, steps=60, slow_every=2)
    assert set(df.step) == set(range(0, 60, 2))  # the slow schedule: every second recorded step
    sigma = df[df.quantity == "spectral_norm"].pivot(index="step", columns="site", values="value")
    rank = df[df.quantity == "stable_rank"].pivot(index="step", columns="site", values="value")
    worst_first, worst_last = 0.0, 0.0
    for name, p in model.named_parameters():
        if p.dim() != 2:
            continue
        w = p.detach().double()
        true = torch.linalg.matrix_norm(w, ord=2).item()
        series = sigma[name].to_numpy()
        # a lower bound that never decreases on fixed weights: the vector is carried from one slow step to the next
        assert (series <= true * (1 + 1e-5)).all(), name
        assert (np.diff(series) >= -1e-5 * true).all(), name
        worst_first = max(worst_first, 1 - series[0] / true)
        worst_last = max(worst_last, 1 - series[-1] / true)
        # tolerance: fp32 matrix-vector products (≈1e-7 relative) and what 1500 iterations leave of the start
        # vector's other directions (≈(σ₂/σ₁)^3000, below 1e-5 for these matrices); 1e-4 leaves room for both
        assert series[-1] == pytest.approx(true, rel=1e-4), name
        frobenius_sq = w.square().sum().item()
        assert rank[name].iloc[-1] == pytest.approx(frobenius_sq / series[-1] ** 2, rel=1e-5), name
        assert rank[name].iloc[-1] == pytest.approx(frobenius_sq / true ** 2, rel=2e-4), name
    assert worst_last < worst_first  # later slow steps are closer: the iterations add up across steps


def test_adam_statistics_with_another_optimizer_warn_once_and_give_no_rows():
    model = build("nanogpt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rec = gradscope.Recorder(model, quantities=["adam_v_sqrt_mean", "adam_v_sqrt_max", "param_norm"], optimizer=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            with rec.step(step):
                loss_of(model, torch.randint(0, VOCAB, (2, 6))).backward()
            opt.step()
            opt.zero_grad()
    rec.close()
    said = [w for w in caught if "keeps no exp_avg_sq" in str(w.message)]
    assert len(said) == 1 and "SGD" in str(said[0].message)
    assert set(rec.frame().quantity) == {"param_norm"}


def test_update_rms_without_the_optimizer_says_so():
    model = build("nanogpt")
    rec = gradscope.Recorder(model, quantities=["update_rms"])
    with pytest.warns(UserWarning, match="update_rms is measured around optimizer.step"), rec.step(0):
        loss_of(model, torch.randint(0, VOCAB, (2, 6))).backward()
    rec.close()


def test_the_default_set_takes_no_weight_statistic():
    model = build("nanogpt")
    opt = torch.optim.AdamW(model.parameters())
    rec = gradscope.Recorder(model, optimizer=opt)
    for step in range(2):
        with rec.step(step):
            loss_of(model, torch.randint(0, VOCAB, (2, 6))).backward()
        opt.step()
    rec.close()
    assert not set(WEIGHTS) & set(rec.frame().quantity)
