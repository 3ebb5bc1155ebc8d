"""The eager capture (recorder/capture/eager.py): which outputs a node hook may read, and the cases a
new-user review found where one may not. Each recorded gradient is checked against
autograd computed here, on a copy of the site value made in an unrecorded forward."""

from __future__ import annotations

import copy

import pytest
import torch
from recorder_ref import assert_rel, site_gradients
from torch import nn
from zoo_cases import batch, tiny

import gradscope


def _recorded(model, run) -> dict[str, float]:
    with gradscope.record(model) as rec:
        run().backward()
    df = rec.frame()
    rows = df[(df.quantity == "act_grad_norm") & (df.micro_step == -1)]
    return dict(zip(rows.site, rows.value))


class _ViewBlock(nn.Module):
    """Returns a view, which the caller then modifies in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return (x + torch.tanh(self.fc(x))).view(-1, 8).view(x.shape)


class _ViewNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_ViewBlock(), _ViewBlock()])

    def forward(self, x, keep=None):
        for b in self.blocks:
            x = b(x)
            if keep is not None:
                keep.append(x)
                x = x.clone()  # the reference keeps the site's value and goes on with a copy
            x.mul_(1.5)  # in place, right after the site: the view's history moves elsewhere
        return x.pow(3).sum()


def test_a_view_output_modified_in_place_after_the_site():
    torch.manual_seed(0)
    model, x = _ViewNet(), torch.randn(2, 4, 8)
    got = _recorded(model, lambda: model(x))
    keep = []
    ref = torch.autograd.grad(model(x, keep), keep)
    for i, g in enumerate(ref):
        assert_rel(got[f"blocks.{i}.out"], g.norm().item(), what=f"blocks.{i}.out")


class _SiteWithOtherUses(nn.Module):
    """A user's gradscope.Site on a tensor that is also used outside the site."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.site = gradscope.Site()

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return (self.b(self.site(h)) + 2 * h).pow(3).sum()


def test_an_identity_site_carries_the_gradient_through_the_site_only():
    torch.manual_seed(0)
    model, x = _SiteWithOtherUses(), torch.randn(2, 4, 8)
    got = _recorded(model, lambda: model(x))
    ref, _ = site_gradients(model, {"site": (model.site, "output")}, lambda: model(x))
    assert_rel(got["site"], ref["site"], what="site")


class _Prefix(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Parameter(torch.randn(2, 4, 8))

    def forward(self):
        return self.q


class _PrefixNet(nn.Module):
    """Blocks that return a leaf (a learned prefix), also used directly."""

    def __init__(self):
        super().__init__()
        self.prefix = nn.ModuleList([_Prefix(), _Prefix()])
        self.fc = nn.Linear(8, 8)

    def forward(self):
        h = self.fc(self.prefix[0]() + self.prefix[1]())
        return h.pow(3).sum() + (self.prefix[0].q * 3).pow(2).sum()


def test_a_leaf_output_is_read_through_the_module_and_leaves_no_hook():
    torch.manual_seed(0)
    model = _PrefixNet()
    rec = gradscope.Recorder(model)
    for step in range(3):
        with rec.step(step):
            model().backward()
        model.zero_grad()
    rec.close()
    got = rec.frame().query("step == 2 and quantity == 'act_grad_norm' and micro_step == -1")
    ref, _ = site_gradients(model, {"prefix.0.out": (model.prefix[0], "output")}, model)
    assert_rel(got[got.site == "prefix.0.out"].value.item(), ref["prefix.0.out"], what="prefix.0.out")
    assert not model.prefix[0].q._backward_hooks


def test_backward_through_a_graph_kept_past_close_runs():
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    rec = gradscope.Recorder(model)
    with rec.step(0):
        logits = model(*batch(model.config))
        loss = logits.float().pow(2).mean()
        loss.backward(retain_graph=True)
    rec.close()
    loss.backward()  # the probe's hook and the node hooks of step 0 stay silent


@pytest.mark.parametrize("variant", ["transparent_attention", "dlcl_pre"])
def test_zoo_layer_inputs_read_elsewhere_carry_the_gradient_through_the_site(variant):
    """Transparent attention and DLCL read layer outputs outside the stack; the zoo's sites
    are identities, read eagerly at an alias (the zoo modifies no site output in place)."""
    torch.manual_seed(0)
    model = gradscope.build_model(tiny(variant))
    twin = copy.deepcopy(model)
    inputs = batch(model.config)
    got = _recorded(model, lambda: model(*inputs).float().pow(2).mean())
    sites = {n: (m, "output") for n, m in twin.named_modules() if isinstance(m, gradscope.Site)}
    ref, _ = site_gradients(twin, sites, lambda: twin(*inputs).float().pow(2).mean())
    assert ref.keys() <= got.keys()
    for name, value in ref.items():
        assert_rel(got[name], value, rel=1e-5, what=name)


class _InPlaceLayerNorm(nn.LayerNorm):
    """A LayerNorm subclass whose forward modifies its input in place (here without changing
    its values): an alias of the input would lose its node, so the recorder keeps the Tap."""

    def forward(self, x):
        x.mul_(1.0)
        return super().forward(x)


class _NormNet(nn.Module):
    """Blocks of residual + norm, on a foreign model: each norm's input is also the residual."""

    def __init__(self, norm_cls):
        super().__init__()
        self.fc = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.norm = nn.ModuleList([norm_cls(8), norm_cls(8)])

    def forward(self, x):
        for fc, norm in zip(self.fc, self.norm):
            h = x + torch.tanh(fc(x))
            x = h + norm(h) * 0.5  # h: the norm's input and the residual
        return x.pow(3).sum()


@pytest.mark.parametrize("norm_cls", [nn.LayerNorm, _InPlaceLayerNorm], ids=["plain", "in_place_subclass"])
def test_a_layer_norm_input_carries_the_gradient_through_the_norm_only(norm_cls):
    """A plain nn.LayerNorm's input is read at an alias, a subclass that modifies its input in
    place through the Tap; both give the gradient through the norm alone, not the total."""
    torch.manual_seed(0)
    model, x = _NormNet(norm_cls), torch.randn(2, 4, 8)
    twin = copy.deepcopy(model)
    got = _recorded(model, lambda: model(x))
    sites = {f"norm.{i}.in": (twin.norm[i], "input") for i in range(2)}
    through, _ = site_gradients(twin, sites, lambda: twin(x))
    total, _ = site_gradients(twin, sites, lambda: twin(x), isolate=False)
    for name in sites:
        assert abs(through[name] / total[name] - 1) > 1e-2, "the case must tell the two apart"
        assert_rel(got[name], through[name], what=name)
