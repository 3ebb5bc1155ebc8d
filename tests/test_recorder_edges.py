"""Edge cases found in review: models changed after the recorder was built, low-precision
LayerNorm statistics, LayerNorm over several dimensions, and a no-grad forward inside a
recorded step. Each value is checked against a reference computed here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from recorder_ref import assert_rel, norm_gains, site_gradients
from torch import nn
from zoo_cases import batch, tiny

import gradscope


def _loss(model, inputs):
    logits = model(*inputs)
    target = torch.arange(logits.shape[:-1].numel()).reshape(logits.shape[:-1]) % model.config.vocab
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _values(df, quantity, micro=-1):
    rows = df[(df.quantity == quantity) & (df.micro_step == micro)]
    return dict(zip(rows.site, rows.value))


def test_module_swapped_after_the_recorder_was_built_is_read_live():
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    rec = gradscope.Recorder(model, quantities=["param_grad_norm"])
    name, old = next((n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear))
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, nn.Linear(old.in_features, old.out_features, bias=old.bias is not None))
    inputs = batch(model.config)
    with rec.step(0):
        _loss(model, inputs).backward()
    total = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters() if p.grad is not None))
    assert_rel(_values(rec.frame(), "param_grad_norm")[""], total, rel=1e-5, what="total after a swap")


@pytest.mark.parametrize("steps_before", [0, 2])
def test_parameters_tied_after_the_recorder_was_built_raise(steps_before: int):
    """A tie made before the first step, or between two recorded steps (the parameters read
    at a step's end are then checked against the last step's, the same objects: no other
    check), is seen."""
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    rec = gradscope.Recorder(model, quantities=["param_grad_norm"])
    for step in range(steps_before):
        with rec.step(step):
            _loss(model, batch(model.config)).backward()
        model.zero_grad()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.shape == (model.config.d_model, model.config.d_model)]
    linears[1].weight = linears[0].weight
    with pytest.raises(RuntimeError, match="parameters changed since the Recorder was built"):
        with rec.step(steps_before):
            _loss(model, batch(model.config)).backward()
    rec.close()
    assert all(not m._forward_hooks for m in model.modules())


def _layernorm_inputs(model, run) -> dict[str, torch.Tensor]:
    """name -> the input each nn.LayerNorm received (first call)."""
    seen: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.setdefault(n, args[0].detach()))
               for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


def _w_over_sigma_ref(ln: nn.LayerNorm, x: torch.Tensor) -> float:
    dims = tuple(range(-len(ln.normalized_shape), 0))
    x = x.double()
    sigma = torch.sqrt(x.var(dim=dims, unbiased=False) + ln.eps)
    return (ln.weight.double().mean() * sigma.reciprocal().mean()).item()


def test_w_over_sigma_of_a_bfloat16_model_is_computed_in_float32():
    """On a CPU, LayerNorm on bf16 input saves a bf16 1/σ; the recorder recomputes it instead."""
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("pre_ln", "decoder", d_model=64, n_heads=4, d_ff=96))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
    model = model.bfloat16()
    inputs = batch(model.config)
    with gradscope.record(model, quantities=["ln_w_over_sigma"]) as rec:
        _loss(model, inputs).backward()
    got = _values(rec.frame(), "ln_w_over_sigma")
    xs = _layernorm_inputs(model, lambda: _loss(model, inputs))
    norms = {n: m for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)}
    assert len(got) == len(norms) > 2
    for site, value in got.items():
        inner = next(n for n in norms if n.startswith(site))
        assert_rel(value, _w_over_sigma_ref(norms[inner], xs[inner]), rel=1e-5, what=site)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm((4, 8))
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.proj(self.norm(x))


class _TwoDimNormNet(nn.Module):
    """A foreign model whose LayerNorms normalise the last two dimensions."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        with torch.no_grad():
            for b in self.blocks:
                b.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("saved_tensor_hooks", [False, True])
def test_w_over_sigma_over_several_normalised_dimensions(saved_tensor_hooks):
    """σ is taken over every normalised dimension, whether read from LayerNorm's saved 1/σ
    or recomputed (as it is while a saved-tensor hook is active)."""
    torch.manual_seed(0)
    model = _TwoDimNormNet()
    x = torch.randn(3, 5, 4, 8) * 2 + 1
    rec = gradscope.Recorder(model, quantities=["ln_w_over_sigma"])
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with rec.step(0):
        if saved_tensor_hooks:
            with hooks:
                loss = model(x).pow(2).mean()
        else:
            loss = model(x).pow(2).mean()
        loss.backward()
    got = _values(rec.frame(), "ln_w_over_sigma")
    xs = _layernorm_inputs(model, lambda: model(x))
    assert set(got) == set(xs) == {"blocks.0.norm", "blocks.1.norm"}
    for name, value in got.items():
        assert_rel(value, _w_over_sigma_ref(model.get_submodule(name), xs[name]), rel=1e-5, what=name)


def test_ln_gain_is_right_after_a_no_grad_forward():
    """Micro-steps are counted by backward passes: a no-grad forward inside a recorded step
    (an evaluation) adds none, and the gains of the step are those of its one backward."""
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    inputs = batch(model.config)
    rec = gradscope.Recorder(model, quantities=["ln_gain"])
    with rec.step(0):
        with torch.no_grad():
            model(*inputs)
        _loss(model, inputs).backward()
    df = rec.frame()
    model.zero_grad()
    gains = df[df.quantity == "ln_gain"]
    assert set(gains.micro_step) == {-1}
    norms = {n: m.inner for n, m in model.named_modules() if isinstance(m, gradscope.SiteNorm)}
    expected = norm_gains(model, norms, lambda: _loss(model, inputs))
    for micro in (-1,):
        got = _values(df, "ln_gain", micro)
        assert set(got) == set(norms)
        for n in norms:
            assert_rel(got[n], expected[n], what=f"{n} micro {micro}")


def test_loss_logged_per_micro_batch_gets_micro_rows_and_their_mean():
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    rec = gradscope.Recorder(model, quantities=["loss"])
    losses = []
    with rec.step(0):
        for seed in (0, 1):
            loss = _loss(model, batch(model.config, seed=seed))
            loss.backward()
            rec.log("loss", loss)
            losses.append(loss.item())
    got = rec.frame(micro_steps=True).set_index("micro_step").value
    assert got[0] == pytest.approx(losses[0]) and got[1] == pytest.approx(losses[1])
    assert got[-1] == pytest.approx(sum(losses) / 2)


def test_sites_filter_restricts_norm_quantities_and_takes_a_string():
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    keep = "decoder.layers.0.self_attn.norm.*"
    rec = gradscope.Recorder(model, quantities="all", sites=keep)  # one pattern as a string
    with rec.step(0):
        _loss(model, batch(model.config)).backward()
    df = rec.frame()
    assert set(df[df.quantity == "act_grad_norm"].site) == {"decoder.layers.0.self_attn.norm.in", "decoder.layers.0.self_attn.norm.out"}
    for q in ("ln_gain", "ln_w_over_sigma"):
        assert set(df[df.quantity == q].site) == {"decoder.layers.0.self_attn.norm"}, q
    assert not len(df[df.quantity == "cosine"])  # the stack's outputs were not kept


def test_cosine_masks_padding_passed_by_position():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    tables = []
    for by_position in (False, True):
        with gradscope.record(model, quantities=["cosine"], slow_every=1) as rec:
            out = model(ids, mask, labels=ids) if by_position else model(input_ids=ids, attention_mask=mask, labels=ids)
            out.loss.backward()
        model.zero_grad()
        tables.append(rec.frame().sort_values(["layer", "layer_j"]).value.to_numpy())
    assert len(tables[0]) == 9 and np.allclose(tables[0], tables[1], rtol=0, atol=1e-7)


def test_no_layer_stack_warns_that_cosine_has_no_rows():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    with pytest.warns(UserWarning, match="no cosine rows"):
        with gradscope.record(model, quantities=["cosine", "act_grad_norm"], slow_every=1):
            model(torch.randn(2, 3, 8)).sum().backward()


def test_a_graph_kept_from_an_earlier_step_writes_nothing_into_this_one():
    """Step 0's graph is kept (retain_graph) and backward runs through it again in step 1:
    step 0's hooks and taps stay silent, so step 1 holds the gradients of its own sites."""
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    first, second = batch(model.config), batch(model.config, seed=1)
    sites = {n: (m, "output") for n, m in model.named_modules() if isinstance(m, gradscope.Site)}
    ref, _ = site_gradients(model, sites, lambda: _loss(model, second))
    model.zero_grad()
    rec = gradscope.Recorder(model, quantities=["act_grad_norm"])
    with rec.step(0):
        kept = _loss(model, first)
        kept.backward(retain_graph=True)
    with rec.step(1):
        (_loss(model, second) + kept).backward()
    got = _values(rec.frame().query("step == 1"), "act_grad_norm")
    assert got.keys() == ref.keys()
    for name, value in ref.items():
        assert_rel(got[name], value, rel=1e-5, what=name)


@pytest.mark.parametrize("quantities", ["default", "all", "signals"])
def test_an_evaluation_step_on_nested_tensors_records_the_real_tokens(quantities):
    """``nn.TransformerEncoder`` in eval under ``no_grad`` with a padding mask runs its layers
    on nested tensors (the fast path): the step records (it crashed in ``reshape``), and a
    layer's ``act_norm`` is the norm of its real tokens (the padding is not in a nested tensor)."""
    import warnings

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(3, 7, 16)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, 4:] = pad[2, 5:] = True
    outputs = {}
    handles = [m.register_forward_hook(lambda mod, args, out, name=name: outputs.setdefault(name, out))
               for name, m in model.layers.named_children()]
    with torch.no_grad():
        model(x, src_key_padding_mask=pad)
    for h in handles:
        h.remove()
    assert all(t.is_nested for t in outputs.values())  # (else this test checks nothing new)
    rec = gradscope.Recorder(model, quantities=quantities)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fast path calls no norm module: said in a warning)
        with torch.no_grad(), rec.step(0):
            model(x, src_key_padding_mask=pad)
    rec.close()
    got = rec.frame().query("quantity == 'act_norm'").set_index("site").value
    for i, out in outputs.items():
        real = torch.cat([t.reshape(-1) for t in out.unbind()])
        assert_rel(got[f"layers.{i}.out"], real.double().norm().item(), rel=1e-6, what=f"layers.{i}.out")


class _NormLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class _SharedDepth(nn.Module):
    """A list that holds one block three times (weights shared across depth), between two
    blocks of their own when ``own_ends``."""

    def __init__(self, own_ends: bool = False):
        super().__init__()
        shared = _NormLinear()
        self.layers = nn.ModuleList([_NormLinear(), shared, shared, _NormLinear()] if own_ends else [shared] * 3)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_list_holding_one_block_several_times_is_one_layer_called_again():
    """``nn.ModuleList([block] * 3)`` raised KeyError; the block is one layer whose calls are
    rows ``#2``, ``#3`` (each call's own values, checked against the block's outputs)."""
    torch.manual_seed(0)
    model, x = _SharedDepth(), torch.randn(4, 5, 8)
    outs = []
    handle = model.layers[0].register_forward_hook(lambda mod, args, out: outs.append(out) or out.retain_grad())
    model(x).square().mean().backward()
    handle.remove()
    reference = [(o.double().norm().item(), o.grad.double().norm().item()) for o in outs]  # (exact: any CPU)
    model.zero_grad(set_to_none=True)
    assert gradscope.site_names(model) == ["layers.0.in", "layers.0.out", "layers.0.ln.in", "layers.0.ln.out"]
    rec = gradscope.Recorder(model, quantities=["act_norm", "act_grad_norm"])
    with rec.step(0):
        model(x).square().mean().backward()
    rec.close()
    df = rec.frame().query("micro_step == -1")
    for call, (value, grad) in enumerate(reference):
        site = "layers.0.out" + ("" if call == 0 else f"#{call + 1}")
        got = df[df.site == site].set_index("quantity").value
        assert_rel(got["act_norm"], value, rel=1e-6, what=site)
        assert_rel(got["act_grad_norm"], grad, rel=1e-6, what=site)
    names = gradscope.site_names(_SharedDepth(own_ends=True))
    assert {n.rpartition(".")[0] for n in names if n.endswith(".out") and n.count(".") == 2} == {"layers.0", "layers.1",
                                                                                                 "layers.3"}


def test_groups_of_a_model_without_a_block_list_are_not_called_embeddings():
    """Without a list of blocks there is no before or after: a Linear or a norm is ``other``
    (every group was ``embedding``), an nn.Embedding still ``embedding``."""
    model = nn.Sequential()
    model.add_module("embed", nn.Embedding(10, 8))
    model.add_module("block", _NormLinear())
    model.add_module("out", nn.Linear(8, 2))
    rec = gradscope.Recorder(nn.ModuleDict(dict(net=model)).net, quantities=["param_grad_norm"])
    with rec.step(0):
        model(torch.randint(0, 10, (2, 3))).sum().backward()
    rec.close()
    roles = rec.frame().set_index("site").role
    assert roles["embed"] == "embedding" and roles["out"] == "other" and roles["block.fc"] == "other"
