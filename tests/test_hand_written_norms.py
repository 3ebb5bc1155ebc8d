"""Hand-written norms (issue 50): nanoGPT's ``LayerNorm`` (``F.layer_norm`` with a literal eps)
and an RMSNorm written here, eager and compiled, fp32 and bf16 autocast, over a training
run: at every step every norm has its ``.in`` and ``ln_gain`` rows, equal to autograd
through that norm alone, and training is bit-identical to a plain copy's.

The reference runs each norm on its own (a view at its input, one norm per run): a view at a
norm's input regroups the sums upstream of it, so with every norm viewed in one run the
gradient reaching the earlier norms would not be the model's (in bf16 by 4e-4)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradscope
from recorder_ref import norm_gains, site_gradients

V, D, T, B = 64, 32, 8, 4


class NanoLayerNorm(nn.Module):
    """nanoGPT's: F.layer_norm, optional bias, eps a literal."""

    def __init__(self, ndim: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(ndim)), nn.Parameter(torch.zeros(ndim))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class HandRMSNorm(nn.Module):
    """An RMSNorm as people write it: computed in fp32, cast back, eps a literal."""

    def __init__(self, ndim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * self.weight


class Block(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = norm(D), nn.Linear(D, 3 * D), norm(D)
        self.proj, self.fc, self.out = nn.Linear(D, D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        q, k, v = self.attn(self.ln_1(x)).split(D, dim=2)
        y = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal=True).squeeze(1)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, norm, n_layer: int = 2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.h = nn.ModuleList([Block(norm) for _ in range(n_layer)])
        self.ln_f, self.head = norm(D), nn.Linear(D, V, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x)).float().view(-1, V), targets.view(-1))


NORMS = {"nanogpt_layernorm": NanoLayerNorm, "hand_rmsnorm": HandRMSNorm}


def _norms(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, (NanoLayerNorm, HandRMSNorm))}


def _reference(model, loss):
    """Per norm: ‖grad through it alone at its input‖ and ln_gain, one norm per run."""
    want_in, want_gain = {}, {}
    for n, m in _norms(model).items():
        want_in.update(site_gradients(model, {f"{n}.in": (m, "input")}, loss)[0])
        want_gain.update(norm_gains(model, {n: m}, loss))
    return want_in, want_gain


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_every_step_of_a_run_has_exact_norm_rows_and_training_is_unchanged(norm, compiled, precision):
    steps = 100 if not compiled else 30
    torch.manual_seed(0)
    model = GPT(NORMS[norm])
    plain, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt, opt_plain = (torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, plain))
    rec = gradscope.Recorder(model, optimizer=opt)
    run, run_plain = ((torch.compile(m, fullgraph=True) if compiled else m) for m in (model, plain))
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    data = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(steps):
        idx = torch.randint(0, V, (B, T), generator=data)
        ref.load_state_dict(model.state_dict())

        def ref_loss(idx=idx):
            with cast:
                return ref(idx, idx)

        want_in, want_gain = _reference(ref, ref_loss)
        with rec.step(step):
            with cast:
                loss = run(idx, idx)
            loss.backward()
        with cast:
            loss_plain = run_plain(idx, idx)
        loss_plain.backward()
        for o in (opt, opt_plain):
            o.step()
            o.zero_grad(set_to_none=True)
        df = rec.frame()
        got = df[df.step == step].set_index(["quantity", "site"]).value
        for site, want in want_in.items():
            assert ("act_grad_norm", site) in got.index, (step, site)  # no row missing
            worst = max(worst, abs(got["act_grad_norm", site] / want - 1))
        for n, want in want_gain.items():
            assert ("ln_gain", n) in got.index, (step, n)
            worst = max(worst, abs(got["ln_gain", n] / want - 1))
    rec.close()
    print(f"worst relative difference {norm} {'compiled' if compiled else 'eager'} {precision}: {worst:.2e}")
    # measured (Intel Xeon VM, 2026-12-02): ≤ 5e-8 eagerly, ≤ 2e-7 compiled in fp32; compiled bf16 ≤ 2.3e-4,
    # as the reference is eager autograd and Inductor's fused bf16 kernels round differently from it
    assert worst <= (1e-3 if compiled and precision == "bf16" else 1e-6), worst
    drift = max(float(((p - q).abs() / q.abs().clamp_min(1e-3)).max()) for p, q in zip(model.parameters(), plain.parameters()))
    if drift and compiled and (precision == "bf16" or torch.get_num_threads() > 1):
        # known, not fixed (docs/capture.md, "Changes nothing"): compiled in bf16 the recorded graph's taps change
        # how Inductor fuses and splits the real gradients' sums (the nn.LayerNorm twin drifts as much, so not the
        # norm's copy; seen at 1 thread on an AMD EPYC, not on the Intel Xeon); compiled fp32 on several threads,
        # Inductor's embedding backward sums in a run-to-run order (plain against plain differs too)
        pytest.xfail(f"compiled {precision} on {torch.get_num_threads()} thread(s): parameters {drift:.1e} off the plain "
                     "copy's (Inductor's fusion of the recorded graph; docs/capture.md)")
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), f"{name}: training with the recorder differs from the plain copy's"
