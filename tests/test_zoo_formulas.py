"""Each SPEC §1 formula checked against a value computed here from the SPEC text."""

from __future__ import annotations

import math

import pytest
import torch

import gradscope
from gradscope.models.residual import BottomToTop, ConstScale
from zoo_cases import batch, tiny


def linears(model, stack):
    for l, layer in enumerate(model.stacks()[stack].layers, start=1):
        for name, m in layer.named_modules():
            if isinstance(m, torch.nn.Linear):
                yield l, name.rsplit(".", 1)[-1], name, m


DEEPNORM_CASES = [
    ("encoder", 4, 1, {"encoder": ((2 * 4) ** 0.25, (8 * 4) ** -0.25)}),
    ("decoder", 1, 5, {"decoder": ((2 * 5) ** 0.25, (8 * 5) ** -0.25)}),
    (
        "encoder_decoder", 4, 3,
        {"encoder": (0.81 * (4**4 * 3) ** (1 / 16), 0.87 * (4**4 * 3) ** (-1 / 16)),
         "decoder": ((3 * 3) ** 0.25, (12 * 3) ** -0.25)},
    ),
]
BETA_ROLES = ("v_proj", "out_proj", "fc1", "fc2")


@pytest.mark.parametrize("arch,N,M,expected", DEEPNORM_CASES)
def test_deepnorm_alpha_and_paper_init(arch, N, M, expected):
    """Wang 2022 Fig. 2: xavier_normal_(gain=β) for ffn, v_proj, out_proj; gain 1 for q_proj,
    k_proj. Checked by each matrix's std against gain·sqrt(2 / (fan_in + fan_out)) (1024+
    entries: ±15 % is over 6 standard errors) and a normal's tail (max > 2.2 std, a uniform's
    is √3)."""
    torch.manual_seed(0)
    deep = gradscope.build_model(tiny("deepnorm", arch, n_enc=N, n_dec=M, d_model=32, d_ff=64))
    for stack, (alpha, beta) in expected.items():
        for layer in deep.stacks()[stack].layers:
            skips = [m for m in layer.modules() if isinstance(m, ConstScale)]
            assert len(skips) == len(layer.sublayer_names)
            assert all(s.value == pytest.approx(alpha, rel=1e-12) for s in skips)
        for _, role, name, m in linears(deep, stack):
            fan_out, fan_in = m.weight.shape
            gain = beta if role in BETA_ROLES else 1.0
            std = float(m.weight.detach().std())
            assert std == pytest.approx(gain * math.sqrt(2 / (fan_in + fan_out)), rel=0.15), f"{stack} {name}"
            assert float(m.weight.detach().abs().max()) > 2.2 * std, f"{stack} {name}: not normal"


@pytest.mark.parametrize("arch,N,M,expected", DEEPNORM_CASES)
def test_deepnorm_torchscale_init(arch, N, M, expected):
    """torchscale: q/k/v xavier_uniform gain 1/√2, out_proj gain 1 (bias 0), fc1/fc2 torch's
    default Linear init (bound 1/sqrt(fan_in)); then fc1, fc2, out_proj, v_proj weights and
    biases divided by init_scale. Checked by each uniform's bound: max |w| <= bound, and > 0.9
    of it (1024+ entries)."""
    scale = {"encoder": (N**4 * M) ** (1 / 16) / 1.15 if arch == "encoder_decoder" else (8 * N) ** 0.25,
             "decoder": (12 * M) ** 0.25 if arch == "encoder_decoder" else (8 * M) ** 0.25}
    torch.manual_seed(0)
    deep = gradscope.build_model(tiny("deepnorm", arch, n_enc=N, n_dec=M, d_model=32, d_ff=64,
                                      deepnorm_init="torchscale"))
    for stack in expected:
        for _, role, name, m in linears(deep, stack):
            fan_out, fan_in = m.weight.shape
            div = scale[stack] if role in BETA_ROLES else 1.0
            if role in ("fc1", "fc2"):
                bound = 1 / math.sqrt(fan_in)
            else:
                bound = (1.0 if role == "out_proj" else 1 / math.sqrt(2)) * math.sqrt(6 / (fan_in + fan_out))
            top = float(m.weight.detach().abs().max())
            assert 0.9 * bound / div < top <= bound / div * (1 + 1e-6), f"{stack} {name}"
            if role == "out_proj" and m.bias is not None:
                assert not m.bias.any(), name
            elif role in ("fc1", "fc2") and m.bias is not None:
                assert 0.5 / math.sqrt(fan_in) / div < float(m.bias.detach().abs().max()) <= 1 / math.sqrt(fan_in) / div + 1e-7


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder", "encoder"])
def test_tfixup_scales(arch):
    N, M = 3, 4
    torch.manual_seed(0)
    fix = gradscope.build_model(tiny("tfixup", arch, n_enc=N, n_dec=M))
    torch.manual_seed(0)
    base = gradscope.build_model(tiny("post_ln", arch, n_enc=N, n_dec=M))
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in fix.modules())
    for stack in fix.stacks():
        s = 0.67 * N**-0.25 if stack == "encoder" else (9 * M) ** -0.25
        e = (9 * N) ** -0.25 if stack == "encoder" else (9 * M) ** -0.25
        expected = {"fc1": s, "fc2": s, "out_proj": s, "v_proj": s * math.sqrt(2), "q_proj": 1.0, "k_proj": 1.0}
        for (_, role, name, a), (_, _, _, b) in zip(linears(fix, stack), linears(base, stack)):
            torch.testing.assert_close(a.weight, b.weight * expected[role], msg=f"{stack} {name}")
        torch.testing.assert_close(fix.stacks()[stack].embed.tokens.weight, base.stacks()[stack].embed.tokens.weight * e)


def test_b2t_noln_coefficients_per_stack():
    model = gradscope.build_model(tiny("b2t_noln", n_enc=30, n_dec=7, d_model=16))
    for stack, N in (("encoder", 30), ("decoder", 7)):
        skips = [m for m in model.stacks()[stack].modules() if isinstance(m, BottomToTop)]
        assert len(skips) == N  # one per layer, on its last sub-layer
        for s in skips:
            assert s.alpha == pytest.approx(min(N / 12, N**-0.15))
            assert s.beta == pytest.approx(16**-0.2)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())


def test_lipschitz_init_bounds():
    torch.manual_seed(0)
    config = tiny("post_ln", init="lipschitz", d_model=32, d_ff=64, n_heads=2, vocab=200)
    model = gradscope.build_model(config)
    for stack in model.stacks():
        for _, role, name, lin in linears(model, stack):
            bound = math.sqrt(1 / lin.in_features)
            assert lin.weight.abs().max() <= bound
            assert lin.weight.abs().max() > 0.95 * bound, name
            assert torch.count_nonzero(lin.bias) == 0
        emb = model.stacks()[stack].embed.tokens.weight
        e = math.sqrt(2 / (32 + 200))
        assert e * 0.95 < emb.abs().max() <= e
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            assert torch.all(m.weight == 1) and torch.all(m.bias == 0)


@pytest.mark.parametrize("form,power", [("paper", 0.5), ("code", 0.25)])
def test_ds_init_bounds(form, power):
    torch.manual_seed(0)
    alpha = 0.7
    model = gradscope.build_model(tiny("post_ln", init="ds_init", n_enc=4, d_model=32, d_ff=64, ds_init_form=form, ds_init_alpha=alpha))
    for l, role, name, lin in linears(model, "encoder"):
        gamma = math.sqrt(6 / (lin.in_features + lin.out_features))
        bound = gamma * alpha / l**power
        assert 0.95 * bound < lin.weight.abs().max() <= bound, (l, name)


def test_small_init_std():
    torch.manual_seed(0)
    d, d_ff = 64, 256
    model = gradscope.build_model(tiny("scalenorm", "encoder", init="small", d_model=d, d_ff=d_ff, n_heads=4, n_enc=3))
    att = torch.cat([lin.weight.flatten() for _, role, _, lin in linears(model, "encoder") if role.endswith("proj")])
    ffn = torch.cat([lin.weight.flatten() for _, role, _, lin in linears(model, "encoder") if role.startswith("fc")])
    assert att.std().item() == pytest.approx(math.sqrt(2 / (5 * d)), rel=0.03)
    assert ffn.std().item() == pytest.approx(math.sqrt(2 / (d + d_ff)), rel=0.03)


def test_xavier_qkv_gain():
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("post_ln", "encoder", d_model=64, n_heads=4, n_enc=3))
    bound = math.sqrt(6 / (64 + 64))
    for _, role, name, lin in linears(model, "encoder"):
        if role in ("q_proj", "k_proj", "v_proj"):
            assert 0.95 * bound / math.sqrt(2) < lin.weight.abs().max() <= bound / math.sqrt(2)
        elif role == "out_proj":
            assert 0.95 * bound < lin.weight.abs().max() <= bound
    emb = model.encoder.embed.tokens.weight
    assert emb.std().item() == pytest.approx(64**-0.5, rel=0.1)


def test_b2t_rescale_switch():
    torch.manual_seed(0)
    on = gradscope.build_model(tiny("b2t", n_enc=4, n_dec=9, b2t_rescale=True))
    torch.manual_seed(0)
    off = gradscope.build_model(tiny("b2t", n_enc=4, n_dec=9))
    for stack, N in (("encoder", 4), ("decoder", 9)):
        for (_, _, name, a), (_, _, _, b) in zip(linears(on, stack), linears(off, stack)):
            torch.testing.assert_close(a.weight, b.weight * N**-0.5, msg=name)


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder"])
def test_admin_profiled_omega_follows_the_recursion(arch):
    """Liu 2020: per stack r=1; ω_i = r; r ← sqrt(Var(ω_i·x_{i-1}) + Var(F_i out)), F_i after its dropout."""
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("admin", arch, n_enc=3, n_dec=3, dropout=0.1))
    inputs = batch(model.config)
    modes = []
    first = next(m for n, m in model.named_modules() if n.count(".") == 3 and hasattr(m, "skip"))
    handle = first.register_forward_pre_hook(lambda mod, args: modes.append(mod.training))
    torch.manual_seed(1)
    omegas = gradscope.admin_init(model, *inputs)
    handle.remove()
    assert modes == [True] and model.training  # profiled in training mode (Transformer-Clinic); mode kept
    # Re-run the now-initialised model and rebuild the recursion from what each sub-layer saw.
    seen = {}
    subs = [(n, m) for n, m in model.named_modules() if n.count(".") == 3 and hasattr(m, "skip")]
    handles = []
    for name, m in subs:
        handles.append(m.register_forward_pre_hook(lambda mod, args, name=name: seen.__setitem__((name, "x"), args[0])))
        handles.append(m.branch.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__((name, "f"), out)))
    model.train()
    torch.manual_seed(1)  # the profile's dropout draws again
    with torch.no_grad():
        model(*inputs)
    for h in handles:
        h.remove()
    running = {}
    for name, m in subs:
        stack = name.split(".")[0]
        r = running.get(stack, 1.0)
        torch.testing.assert_close(m.skip.omega.detach(), torch.full_like(m.skip.omega, r), msg=name)
        assert omegas[name] == pytest.approx(r, rel=1e-6)
        x, f = seen[(name, "x")], seen[(name, "f")]
        running[stack] = math.sqrt(torch.var(r * x, unbiased=False).item() + torch.var(f, unbiased=False).item())
    assert len(omegas) == len(subs) > 0
    model.eval()
    gradscope.admin_init(model, *inputs)
    assert not model.training  # an eval-mode model is profiled in training mode and given back in eval mode


def test_admin_init_rejects_other_variants():
    model = gradscope.build_model(tiny("post_ln"))
    with pytest.raises(ValueError, match="admin"):
        gradscope.admin_init(model, *batch(model.config))
