"""Failure classes measured on the recorder with non-zoo models (x-transformers-, HF- and
nanoGPT-like code): each test builds a minimal model here and checks the recorder against
a reference computed here (autograd.grad on tensors captured with our own hooks, p.grad,
closed-form statistics), never against pasted numbers."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import gradscope
from recorder_ref import _first, all_hook_dicts_empty, assert_rel, norm_gains

D = 16  # feature width of every model here
B, T = 2, 5


# -- helpers ----------------------------------------------------------------------------------
def _values(df, quantity, micro=-1):
    rows = df[(df.quantity == quantity) & (df.micro_step == micro)]
    return dict(zip(rows.site, rows.value))


def _x(seed=0, shape=(B, T, D)):
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


def _grad_norm(params) -> float:
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
    model, x = NoneListModel(), _x()
    run = lambda: model(x).pow(2).mean()  # noqa: E731
    rec = gradscope.Recorder(model)  # must not crash
    with rec.step(0):
        run().backward()
    rec.close()
    df = rec.frame()
    assert not df.site.str.startswith("skip_combines").any()
    taps = {f"layers.{i}.{w}": (model.layers[i], w) for i in range(2) for w in ("in", "out")}
    ref, act, _ = tap(run, taps)
    got, got_act = _values(df, "act_grad_norm"), _values(df, "act_norm")
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
    x = _x().requires_grad_()
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
    got, got_act = _values(df, "act_grad_norm"), _values(df, "act_norm")
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
    model, x, z = AdaModel(), _x(), _x(1, (B, 4))
    run = lambda: model(x, z).pow(2).mean()  # noqa: E731
    # The gain of an adaptive norm depends on the token; the norm run again alone with the
    # call's own keyword-only `condition` (detached) gives the gradient through it alone at its
    # input exactly, and no gradient reaches `cond` from that copy (training is unchanged).
    with gradscope.record(model) as rec:
        run().backward()  # an earlier recorder re-ran norm.forward(x) without `condition` here
    df = rec.frame()
    ref_out, act_out, _ = tap(run, {"norm.out": (model.norm, "out"), "norm.in": (model.norm, "in_iso")})
    got = _values(df, "act_grad_norm")
    assert_rel(got["norm.in"], ref_out["norm.in"], what="norm.in")
    assert_rel(_values(df, "ln_gain")["norm"], ref_out["norm.in"] / ref_out["norm.out"], what="ln_gain")
    assert_rel(got["norm.out"], ref_out["norm.out"], what="norm.out")
    assert_rel(_values(df, "act_norm")["norm.out"], act_out["norm.out"], what="norm.out act_norm")


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
    x = _x().requires_grad_()
    run = lambda: model(x).pow(3).mean()  # noqa: E731
    with gradscope.record(model) as rec:
        run().backward()
    df = rec.frame()
    assert not df.site.str.contains("parametrizations").any(), sorted(set(df.site))
    assert not any("parametrizations" in s for s in rec.site_names)
    total = _grad_norm(model.parameters())
    assert_rel(_values(df, "param_grad_norm")[""], total, what="total param_grad_norm")
    model.zero_grad()
    taps = {f"layers.{i}.out": (model.layers[i], "out") for i in range(2)}
    ref, _, _ = tap(run, taps)
    got = _values(df, "act_grad_norm")
    for site in taps:
        assert_rel(got[site], ref[site], what=site)
    assert_rel(_values(df, "ln_gain")["ln"], norm_gains(model, {"ln": model.ln}, run)["ln"], what="ln_gain ln")


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
        x = _x(step)
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
    x0 = _x(0)
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
    model, wave = FeatureEncoder(), _x(0, (B, 40))
    run = lambda: model(wave).pow(2).mean()  # noqa: E731
    with gradscope.record(model, quantities="all") as rec:
        run().backward()  # leaving the step must not crash
    df = rec.frame()
    taps = {"conv_layers.0.out": (model.conv_layers[0], "out"), "conv_layers.1.in": (model.conv_layers[1], "in"),
            "conv_layers.1.out": (model.conv_layers[1], "out")}
    ref, act, _ = tap(run, taps)
    got, got_act = _values(df, "act_grad_norm"), _values(df, "act_norm")
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
    model, x = KwModel(), _x()
    run = lambda: model(x).pow(3).mean()  # noqa: E731
    with gradscope.record(model) as rec:
        run().backward()
    df = rec.frame()
    taps = {f"{s}.{i}.in": (getattr(model, s)[i], "in") for s in ("a", "b") for i in range(2)}
    ref, act, _ = tap(run, taps)
    got, got_act = _values(df, "act_grad_norm"), _values(df, "act_norm")
    for site in taps:
        assert site in got, f"no act_grad_norm row for {site}"
        assert_rel(got[site], ref[site], what=site)
        assert_rel(got_act[site], act[site], what=site)


# -- 7. an in-place op after a site ----------------------------------------------------------------
class InplaceBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)

    def forward(self, x):
        o = self.ln(x + self.fc(x))
        o.mul_(0.5)
        return o


def inplace_model():
    return Chain([InplaceBlock(), InplaceBlock()])


def test_inplace_op_after_a_site():
    torch.manual_seed(0)
    model, x = inplace_model(), _x()
    run = lambda: model(x).pow(2).mean()  # noqa: E731
    with gradscope.record(model) as rec:
        run().backward()
    df = rec.frame()
    # reference: the ln output is captured and a clone passed on, so mul_ leaves the captured
    # (pre-mul) tensor alone; the block output is captured after the mul.
    taps = {}
    for i in range(2):
        taps[f"blocks.{i}.ln.out"] = (model.blocks[i].ln, "out_clone")
        taps[f"blocks.{i}.ln.in"] = (model.blocks[i].ln, "in_iso")
        taps[f"blocks.{i}.out"] = (model.blocks[i], "out")
    ref, act, _ = tap(run, taps)
    for i in range(2):  # the reference itself tells the two sites apart
        assert_rel(act[f"blocks.{i}.ln.out"], 2 * act[f"blocks.{i}.out"], what="reference act")
        assert_rel(ref[f"blocks.{i}.out"], 2 * ref[f"blocks.{i}.ln.out"], what="reference grad")
    got, got_act, gain = _values(df, "act_grad_norm"), _values(df, "act_norm"), _values(df, "ln_gain")
    for i in range(2):
        for site in (f"blocks.{i}.ln.out", f"blocks.{i}.out"):
            assert_rel(got_act[site], act[site], what=f"act_norm {site}")
            assert_rel(got[site], ref[site], what=f"act_grad_norm {site}")
        expected_gain = ref[f"blocks.{i}.ln.in"] / ref[f"blocks.{i}.ln.out"]
        assert_rel(gain[f"blocks.{i}.ln"], expected_gain, what=f"ln_gain blocks.{i}.ln")


# -- 8a. a module shared by two blocks --------------------------------------------------------------
class SharedBlock(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.shared = shared
        self.own = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.own(x) + self.shared(x))


class SharedModel(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.Linear(D, D)
        self.blocks = nn.ModuleList([SharedBlock(shared), SharedBlock(shared)])

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


def test_shared_module_counts_in_each_block_and_once_in_total():
    torch.manual_seed(0)
    model, x = SharedModel(), _x()
    with gradscope.record(model) as rec:
        model(x).pow(3).mean().backward()
    pg = _values(rec.frame(), "param_grad_norm")
    assert model.blocks[0].shared is model.blocks[1].shared
    for i in range(2):
        assert_rel(pg[f"blocks.{i}"], _grad_norm(model.blocks[i].parameters()), what=f"blocks.{i}")
    assert_rel(pg[""], _grad_norm(model.parameters()), what="total")  # parameters() yields the shared ones once


# -- 8b. a norm called three times per forward ----------------------------------------------------
class ThriceNormModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.3)
            self.norm.bias.normal_(0.0, 0.1)

    def forward(self, x):
        a = self.norm(self.fc1(x))
        b = self.norm(self.fc2(a))
        return self.norm(self.fc3(b) + 2 * a)


def test_norm_called_three_times_has_a_site_per_call():
    torch.manual_seed(0)
    model, x = ThriceNormModel(), _x()
    run = lambda: model(x).pow(3).mean()  # noqa: E731
    with gradscope.record(model) as rec:
        run().backward()
    df = rec.frame()
    ref_out, act_out, _ = tap(run, {"norm.out": (model.norm, "out")})
    ref_in, _, _ = tap(run, {"norm.in": (model.norm, "in_iso")})
    assert sorted(ref_out) == ["norm.out", "norm.out#2", "norm.out#3"]
    got, got_act = _values(df, "act_grad_norm"), _values(df, "act_norm")
    for site in ref_out:
        assert site in got, f"no row for {site}; sites: {sorted(set(df.site))}"
        assert_rel(got[site], ref_out[site], what=site)
        assert_rel(got_act[site], act_out[site], what=f"act_norm {site}")
    for site in ref_in:
        assert_rel(got[site], ref_in[site], what=f"{site} (through the norm alone)")


# -- 9. ln_w_over_sigma for common hand-written norm classes -------------------------------------------
class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm with an optional bias."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        return (output * (1.0 + self.weight.float())).type_as(x)


class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


NORM_CLASSES = {  # name -> (build, sigma kind, eps, effective gain from weight)
    "nanogpt": (lambda: LayerNorm(D, bias=True), "var", 1e-5, lambda w: w),
    "nanogpt_nobias": (lambda: LayerNorm(D, bias=False), "var", 1e-5, lambda w: w),
    "llama": (lambda: LlamaRMSNorm(D), "rms", 1e-6, lambda w: w),
    "gemma": (lambda: GemmaRMSNorm(D), "rms", 1e-6, lambda w: 1 + w),
    "t5": (lambda: T5LayerNorm(D), "rms", 1e-6, lambda w: w),
}


class NormModel(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.norm = norm
        self.head = nn.Linear(D, D)

    def forward(self, x):
        return self.head(self.norm(self.inp(x) + 1.0))  # non-zero token means: variance != mean square


@pytest.mark.parametrize("kind", sorted(NORM_CLASSES))
def test_ln_w_over_sigma_for_hand_written_norms(kind):
    torch.manual_seed(0)
    build, sigma_kind, eps, gain_of = NORM_CLASSES[kind]
    model = NormModel(build())
    with torch.no_grad():
        model.norm.weight.add_(0.3 * torch.randn(D))  # a gain that is neither all ones nor all zeros
    x = _x()
    with gradscope.record(model, quantities="all") as rec:
        model(x).pow(2).mean().backward()
    _, _, seen = tap(lambda: model(x).pow(2).mean(), {"norm.in": (model.norm, "in")})
    h = seen["norm.in"].double()
    if sigma_kind == "var":
        sigma = torch.sqrt(h.var(dim=-1, unbiased=False) + eps)
    else:
        sigma = torch.sqrt(h.pow(2).mean(dim=-1) + eps)
    g = gain_of(model.norm.weight.detach().double())
    expected = (g / sigma[..., None]).mean().item()  # mean over tokens and features of g_f / σ_t
    got = _values(rec.frame(), "ln_w_over_sigma")
    assert "norm" in got, f"no ln_w_over_sigma for {type(model.norm).__name__}"
    assert_rel(got["norm"], expected, rel=1e-5, what=f"ln_w_over_sigma {kind}")


# -- 10. leaving the step inside autocast -------------------------------------------------------------
def blocks_model(depth=2):
    return Chain([MLPBlock() for _ in range(depth)])


def test_param_grad_norm_in_fp32_when_the_step_closes_under_autocast():
    torch.manual_seed(0)
    model, x = blocks_model(), _x()
    rec = gradscope.Recorder(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with rec.step(0):
            loss = model(x).float().pow(2).mean()
            loss.backward()
    rec.close()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    pg = _values(rec.frame(), "param_grad_norm")
    assert_rel(pg[""], _grad_norm(model.parameters()), rel=1e-6, what="total")
    for i in range(2):
        assert_rel(pg[f"blocks.{i}"], _grad_norm(model.blocks[i].parameters()), rel=1e-6, what=f"blocks.{i}")


# -- 11. encoder padding mask must not weight the decoder's cosine ------------------------------------
def test_t5_encoder_padding_mask_does_not_weight_decoder_cosine():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=48, d_kv=16, num_heads=2,
                                vocab_size=60, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(0)
    n_tok = 8  # encoder and decoder lengths equal: a (B, T) encoder mask has the decoder's token count
    ids = torch.randint(1, 60, (B, n_tok), generator=g)
    labels = torch.randint(1, 60, (B, n_tok), generator=g)
    mask = torch.zeros(B, n_tok, dtype=torch.long)
    mask[0, :3] = 1
    mask[1, :1] = 1
    run = lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss  # noqa: E731
    # cosine_tokens far above the 16 decoder tokens: every decoder token is in the sample
    with gradscope.record(model, quantities="all", options=gradscope.RecorderOptions(cosine_tokens=4096)) as rec:
        run().backward()
    df = rec.frame()
    blocks = model.decoder.block
    _, _, seen = tap(run, {"y0": (blocks[0], "in"), **{f"y{i + 1}": (blocks[i], "out") for i in range(len(blocks))}})
    ys = [F.normalize(seen[f"y{i}"].double().reshape(-1, cfg.d_model), dim=-1) for i in range(len(blocks) + 1)]
    expected = torch.stack([torch.stack([(a * b).sum(-1).mean() for b in ys]) for a in ys])  # all decoder tokens
    cos = df[(df.quantity == "cosine") & (df["stack"] == "decoder.block") & (df.micro_step == -1)]
    assert len(cos) == (len(blocks) + 1) ** 2, f"decoder cosine rows: {len(cos)}"
    worst = max(abs(r.value - expected[int(r.layer), int(r.layer_j)].item()) for r in cos.itertuples())
    assert worst < 1e-2, f"decoder cosine differs from the all-token reference by {worst}"
