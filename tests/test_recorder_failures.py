"""Failure classes measured on the recorder with non-zoo models (x-transformers-, HF- and
nanoGPT-like code), part 1: containers, adaptive and weight-normed layers, stable-LN layers,
batch norm, blocks that change width or take other keywords. Each test builds a minimal model
here and checks the recorder against a reference computed here (autograd.grad on tensors
captured with our own hooks, p.grad, closed-form statistics), never against pasted numbers.
Part 2: tests/test_recorder_failures_reuse.py."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import gradscope
from failure_helpers import B, D, T, Chain, MLPBlock, grad_norm_of, inputs, tap, values_by_site
from recorder_ref import all_hook_dicts_empty, assert_rel, norm_gains


# -- 1. a ModuleList holding only None ------------------------------------------------------------
class NoneListModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.skip_combines = nn.ModuleList([None, None, None])  # as x-transformers keeps them
        self.layers = nn.ModuleList([MLPBlock(), MLPBlock()])
        self.head = nn.Linear(D, D)

    def forward(self, x):
        h = self.inp(x)
        for layer, skip in zip(self.layers, self.skip_combines):
            assert skip is None
            h = layer(h)
        return self.head(h)


def test_modulelist_of_none_is_not_the_repeated_blocks():
    torch.manual_seed(0)
    model, x = NoneListModel(), inputs()
    run = lambda: model(x).pow(2).mean()  # noqa: E731
    rec = gradscope.Recorder(model)  # must not crash
    with rec.step(0):
        run().backward()
    rec.close()
    df = rec.frame()
    assert not df.site.str.startswith("skip_combines").any()
    taps = {f"layers.{i}.{w}": (model.layers[i], w) for i in range(2) for w in ("in", "out")}
    ref, act, _ = tap(run, taps)
    got, got_act = values_by_site(df, "act_grad_norm"), values_by_site(df, "act_norm")
    for site in taps:
        assert_rel(got[site], ref[site], what=site)
        assert_rel(got_act[site], act[site], what=site)
    row = df[(df.site == "layers.1.out") & (df.quantity == "act_grad_norm")].iloc[0]
    assert row["stack"] == "layers" and row.layer == 2 and row.role == "layer_out"
    assert all_hook_dicts_empty(model) == []


# -- 2. containers that are never called (x-transformers layout) ------------------------------------
class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        return self.net(x)


class Residual(nn.Module):
    def forward(self, x, residual):
        return x + residual


class XLike(nn.Module):
    """layers[i] = ModuleList([norms, block, residual]), norms = ModuleList([pre_norm, None, None])."""

    def __init__(self, depth=3):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.ModuleList([nn.LayerNorm(D), None, None]), FeedForward(), Residual()]) for _ in range(depth)
        )
        self.final = nn.LayerNorm(D)

    def forward(self, x):
        h = x
        for norms, block, residual in self.layers:
            h = residual(block(norms[0](h)), h)
        return self.final(h)


def test_uncalled_containers_are_not_silently_empty_sites():
    torch.manual_seed(0)
    model = XLike()
    x = inputs().requires_grad_()
    run = lambda: model(x).pow(3).mean()  # noqa: E731
    rec = gradscope.Recorder(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rec.step(0):
            run().backward()
    rec.close()
    df = rec.frame()
    messages = " ".join(str(w.message) for w in caught)
    silent = [s for s in rec.site_names if s not in set(df.site) and s not in messages]
    assert silent == [], f"sites with no row and no warning: {silent}"
    taps = {f"layers.{i}.1.{w}": (model.layers[i][1], w) for i in range(3) for w in ("in", "out")}
    ref, act, _ = tap(run, taps)
    got, got_act = values_by_site(df, "act_grad_norm"), values_by_site(df, "act_norm")
    for site in taps:
        assert site in got, f"{site} not recorded; sites: {sorted(set(df.site))}"
        assert_rel(got[site], ref[site], what=site)
        assert_rel(got_act[site], act[site], what=site)
    layers = df[(df.site == "layers.2.1.out") & (df.quantity == "act_grad_norm")]
    assert layers.layer.tolist() == [3] and layers["stack"].tolist() == ["layers"]


# -- 3a. adaptive LayerNorm with a keyword-only condition ----------------------------------------
class AdaLayerNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(d))
        self.bias = nn.Parameter(0.1 * torch.randn(d))

    def forward(self, x, *, condition):
        y = F.layer_norm(x, (x.shape[-1],), eps=1e-5)
        return y * self.weight * (1 + condition) + self.bias


class AdaModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.cond = nn.Linear(4, D)
        self.norm = AdaLayerNorm(D)
        self.head = nn.Linear(D, D)

    def forward(self, x, z):
        c = self.cond(z).unsqueeze(1)
        h = self.inp(x)
        return self.head(h + self.norm(h, condition=c))  # residual: the norm input has a second use


def test_adaptive_norm_with_keyword_only_condition():
    torch.manual_seed(0)
    model, x, z = AdaModel(), inputs(), inputs(1, (B, 4))
    run = lambda: model(x, z).pow(2).mean()  # noqa: E731
    # The gain of an adaptive norm depends on the token; the norm run again alone with the
    # call's own keyword-only `condition` (detached) gives the gradient through it alone at its
    # input exactly, and no gradient reaches `cond` from that copy (training is unchanged).
    with gradscope.record(model) as rec:
        run().backward()  # an earlier recorder re-ran norm.forward(x) without `condition` here
    df = rec.frame()
    ref_out, act_out, _ = tap(run, {"norm.out": (model.norm, "out"), "norm.in": (model.norm, "in_iso")})
    got = values_by_site(df, "act_grad_norm")
    assert_rel(got["norm.in"], ref_out["norm.in"], what="norm.in")
    assert_rel(values_by_site(df, "ln_gain")["norm"], ref_out["norm.in"] / ref_out["norm.out"], what="ln_gain")
    assert_rel(got["norm.out"], ref_out["norm.out"], what="norm.out")
    assert_rel(values_by_site(df, "act_norm")["norm.out"], act_out["norm.out"], what="norm.out act_norm")


# -- 3b. weight_norm parametrization: _WeightNorm is not a norm ----------------------------------------
class WNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = weight_norm(nn.Linear(D, D))

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class WNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([WNBlock(), WNBlock()])
        self.ln = nn.LayerNorm(D)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.ln(x)


def test_weight_norm_parametrization_is_not_a_norm():
    torch.manual_seed(0)
    model = WNModel()
    x = inputs().requires_grad_()
    run = lambda: model(x).pow(3).mean()  # noqa: E731
    with gradscope.record(model) as rec:
        run().backward()
    df = rec.frame()
    assert not df.site.str.contains("parametrizations").any(), sorted(set(df.site))
    assert not any("parametrizations" in s for s in rec.site_names)
    total = grad_norm_of(model.parameters())
    assert_rel(values_by_site(df, "param_grad_norm")[""], total, what="total param_grad_norm")
    model.zero_grad()
    taps = {f"layers.{i}.out": (model.layers[i], "out") for i in range(2)}
    ref, _, _ = tap(run, taps)
    got = values_by_site(df, "act_grad_norm")
    for site in taps:
        assert_rel(got[site], ref[site], what=site)
    assert_rel(values_by_site(df, "ln_gain")["ln"], norm_gains(model, {"ln": model.ln}, run)["ln"], what="ln_gain ln")


# -- 3c. an encoder layer whose class name ends in "StableLayerNorm" ------------------------------------
class EncoderLayerStableLayerNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)
        self.dropout = nn.Dropout(0.1)
        self.final_layer_norm = nn.LayerNorm(D)
        self.ff = nn.Linear(D, D)

    def forward(self, hidden_states):
        h = hidden_states + self.dropout(self.fc(self.layer_norm(hidden_states)))
        return h + self.dropout(self.ff(self.final_layer_norm(h)))


def stable_encoder():
    return Chain([EncoderLayerStableLayerNorm(), EncoderLayerStableLayerNorm()], "layers")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _train(make, record: bool, steps: int = 3, **kwargs):
    """Trains a fresh ``make()`` for ``steps`` steps; returns (model, recorder frame or None, rng state)."""
    torch.manual_seed(0)
    model = make()
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec = gradscope.Recorder(model, optimizer=opt, **kwargs) if record else None
    for step in range(steps):
        x = inputs(step)
        with rec.step(step) if record else _null():
            model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if rec is not None:
        rec.close()
    return model, (rec.frame() if rec is not None else None), torch.get_rng_state()


def test_stable_layer_norm_encoder_layer_is_not_a_norm():
    plain, _, rng_plain = _train(stable_encoder, record=False)
    recorded, df, rng_rec = _train(stable_encoder, record=True, quantities="all")
    for (n, p), (_, q) in zip(plain.named_parameters(), recorded.named_parameters()):
        assert torch.equal(p, q), n
    assert torch.equal(rng_plain, rng_rec), "the recorder drew from the global RNG"
    gains = set(df[df.quantity == "ln_gain"].site)
    real_norms = {f"layers.{i}.{n}" for i in range(2) for n in ("layer_norm", "final_layer_norm")}
    assert gains == real_norms, gains
    block_rows = df[df.site.isin([f"layers.{i}.{w}" for i in range(2) for w in ("in", "out")])]
    assert set(block_rows.role) <= {"layer_in", "layer_out"}, set(block_rows.role)  # block sites, not norm sites


# -- 4. a BatchNorm-backed norm in training mode ---------------------------------------------------
class SeqBatchNorm(nn.BatchNorm1d):
    """BatchNorm over the features of (B, T, C) inputs."""

    def forward(self, x):
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class BNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = SeqBatchNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class BNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList([BNBlock(), BNBlock()])
        self.final = nn.BatchNorm1d(D)
        self.head = nn.Linear(D, D)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h)
        h = self.final(h.reshape(-1, D)).reshape(h.shape)
        return self.head(h)


def test_batchnorm_running_stats_untouched_by_the_recorder():
    torch.manual_seed(0)
    reference = BNModel().train()
    x0 = inputs(0)
    expected = norm_gains(reference, {"blocks.0.norm": reference.blocks[0].norm, "blocks.1.norm": reference.blocks[1].norm,
                                      "final": reference.final}, lambda: reference(x0).pow(2).mean())
    plain, _, _ = _train(BNModel, record=False)
    recorded, df, _ = _train(BNModel, record=True, quantities="all")
    for (n, p), (_, q) in zip(plain.named_buffers(), recorded.named_buffers()):
        assert torch.equal(p, q), f"buffer {n}: {p} vs {q}"
    for (n, p), (_, q) in zip(plain.named_parameters(), recorded.named_parameters()):
        assert torch.equal(p, q), n
    gains = df[(df.quantity == "ln_gain") & (df.step == 0) & (df.micro_step == -1)]
    gains = dict(zip(gains.site, gains.value))
    for name, value in expected.items():
        assert name in gains, f"no ln_gain for {name}"
        assert_rel(gains[name], value, what=f"ln_gain {name}")


# -- 5. same-class blocks that change feature width ---------------------------------------------------
class ConvBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel_size=3, stride=2)

    def forward(self, x):
        return F.gelu(self.conv(x))


class FeatureEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_layers = nn.ModuleList([ConvBlock(1, 8), ConvBlock(8, 16)])
        self.proj = nn.Linear(16, D)

    def forward(self, wave):
        h = wave[:, None]
        for conv in self.conv_layers:
            h = conv(h)
        return self.proj(h.transpose(1, 2))


def test_blocks_changing_width_with_all_quantities():
    torch.manual_seed(0)
    model, wave = FeatureEncoder(), inputs(0, (B, 40))
    run = lambda: model(wave).pow(2).mean()  # noqa: E731
    with gradscope.record(model, quantities="all") as rec:
        run().backward()  # leaving the step must not crash
    df = rec.frame()
    taps = {"conv_layers.0.out": (model.conv_layers[0], "out"), "conv_layers.1.in": (model.conv_layers[1], "in"),
            "conv_layers.1.out": (model.conv_layers[1], "out")}
    ref, act, _ = tap(run, taps)
    got, got_act = values_by_site(df, "act_grad_norm"), values_by_site(df, "act_norm")
    for site in taps:
        assert_rel(got[site], ref[site], what=site)
        assert_rel(got_act[site], act[site], what=site)


# -- 6. blocks called with keywords other than hidden_states ------------------------------------------
class KwBlockX(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, *, x):
        return x + torch.tanh(self.fc(x))


class KwBlockH(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.pe = nn.Embedding(T, D)

    def forward(self, pos=None, h_in=None):
        return h_in + torch.tanh(self.fc(h_in)) + self.pe(pos)


class KwModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.a = nn.ModuleList([KwBlockX(), KwBlockX()])
        self.b = nn.ModuleList([KwBlockH(), KwBlockH()])

    def forward(self, x):
        h = self.inp(x)
        for blk in self.a:
            h = blk(x=h)
        pos = torch.arange(T)  # an integer tensor keyword comes first: not the block input
        for blk in self.b:
            h = blk(pos=pos, h_in=h)
        return h


def test_blocks_called_with_other_keywords_get_in_rows():
    torch.manual_seed(0)
    model, x = KwModel(), inputs()
    run = lambda: model(x).pow(3).mean()  # noqa: E731
    with gradscope.record(model) as rec:
        run().backward()
    df = rec.frame()
    taps = {f"{s}.{i}.in": (getattr(model, s)[i], "in") for s in ("a", "b") for i in range(2)}
    ref, act, _ = tap(run, taps)
    got, got_act = values_by_site(df, "act_grad_norm"), values_by_site(df, "act_norm")
    for site in taps:
        assert site in got, f"no act_grad_norm row for {site}"
        assert_rel(got[site], ref[site], what=site)
        assert_rel(got_act[site], act[site], what=site)


# -- 7. an in-place op after a site ----------------------------------------------------------------
