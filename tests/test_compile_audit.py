"""``gradscope.compile_audit`` and ``gradscope compile-audit``: a divergence planted under
``torch.compiler.is_compiling()`` (in the forward of a block, and in the backward only) is named
at its site; a model without a plant (one written here, and HF GPT-2 with its dropout on) passes;
the eager values equal references computed here with plain autograd; the model, its gradients,
buffers and the RNG are left as they were."""

from __future__ import annotations

import copy
import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradscope
from gradscope.__main__ import main

D, VOCAB, B, T = 16, 50, 2, 7


class _ScaledGrad(torch.autograd.Function):
    """Identity forward; its backward multiplies the gradient by 1.5 when compiled (a planted backward bug)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.5 if torch.compiler.is_compiling() else grad


class Block(nn.Module):
    """Pre-LN residual block; ``plant="forward"`` multiplies its output by 1.5 when compiled,
    ``plant="backward"`` the gradient into its feed-forward."""

    def __init__(self, plant: str | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.ff = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Dropout(dropout), nn.Linear(2 * D, D))
        self.plant = plant
        self.register_buffer("calls", torch.zeros(()))  # (changed by every forward: the audit must put it back)

    def forward(self, x):
        self.calls += 1
        h = self.norm(x)
        if self.plant == "backward":
            h = _ScaledGrad.apply(h)
        y = x + self.ff(h)
        if self.plant == "forward" and torch.compiler.is_compiling():
            y = y * 1.5
        return y


class Net(nn.Module):
    def __init__(self, plant: str | None = None, at: int = 1, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(plant if i == at else None, dropout) for i in range(3))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def planted_net() -> nn.Module:
    """The command line's factory: a Net with a forward plant in block 1."""
    return Net("forward")


def plain_net() -> nn.Module:
    return Net()


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(3))


def _loss(ids):
    return lambda out: F.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _value(result, site, quantity):
    return result.table[(result.table.site == site) & (result.table.quantity == quantity)].iloc[0]


@pytest.fixture(scope="module")
def planted():
    torch.manual_seed(0)
    model = Net("forward")
    ids = _ids()
    return model, ids, gradscope.compile_audit(model, ids, _loss(ids))


def test_a_forward_plant_is_named_at_its_site(planted):
    model, ids, result = planted
    assert not result.passed
    first = result.first
    assert (first.site, first.quantity, first.phase) == ("blocks.1.out", "act_norm", "forward")
    out = {}
    reference = copy.deepcopy(model)
    reference.blocks[1].register_forward_hook(lambda m, a, y: out.update(y=y.detach().double()))
    with torch.no_grad():
        reference(ids)
    assert first.eager == pytest.approx(out["y"].norm().item(), rel=1e-5)  # ‖h‖ of the eager forward
    assert first.compiled == pytest.approx(1.5 * out["y"].norm().item(), rel=1e-5)  # the plant's ×1.5
    assert first.rel_diff == pytest.approx(1 / 3, rel=1e-5)
    upstream = result.table[(result.table.phase == "forward") & (result.table.order < _value(result, "blocks.1.out",
                                                                                               "act_norm").order)]
    assert len(upstream) >= 6 and not upstream.past.any()  # every site before it agrees
    assert "blocks.1.out" in result.summary()


def test_the_figure_draws_every_difference_the_tolerance_and_the_first(planted):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, _, result = planted
    ax = result.figure()
    drawn = {line.get_label(): line for line in ax.lines}
    forward = result.table[result.table.phase == "forward"]
    line = drawn[next(k for k in drawn if k.startswith("forward"))]
    assert list(line.get_xdata()) == forward.order.tolist()
    assert list(line.get_ydata()) == pytest.approx(forward.rel_diff.clip(lower=1e-12).tolist())
    assert list(drawn[f"tolerance {result.tolerance:g}"].get_ydata()) == [result.tolerance] * 2
    circled = drawn["first: act_norm at blocks.1.out"]
    assert circled.get_ydata()[0] == pytest.approx(1 / 3, rel=1e-5)
    assert "blocks.1.out" in ax.get_title()
    plt.close("all")


def test_a_backward_only_plant_is_named_where_the_gradient_first_differs():
    torch.manual_seed(0)
    ids = _ids()
    result = gradscope.compile_audit(Net("backward"), ids, _loss(ids))
    assert not result.table[result.table.phase == "forward"].past.any()  # the forward is the same
    assert (result.first.site, result.first.quantity, result.first.phase) == ("blocks.1.norm.out", "act_grad_norm",
                                                                              "backward")
    assert result.first.rel_diff == pytest.approx(1 / 3, rel=1e-4)
    at = _value(result, "blocks.1.norm.out", "act_grad_norm").order
    before = result.table[(result.table.phase == "backward") & (result.table.order < at)]
    assert len(before) >= 5 and not before.past.any()  # the gradients backward produced before it (downstream) agree


def test_a_model_without_a_plant_passes_with_dropout_on_and_is_left_as_it_was():
    torch.manual_seed(0)
    model = Net(dropout=0.3).train()
    ids = _ids()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    grads = {p: p.grad for p in model.parameters()}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    # references in the test: a plain eager backward on a copy, from the same RNG state
    reference = copy.deepcopy(model)
    for p in reference.parameters():
        p.grad = None
    with torch.random.fork_rng():
        ref_loss = _loss(ids)(reference(ids))
        ref_loss.backward()
    result = gradscope.compile_audit(model, ids, _loss(ids))
    assert result.passed, result.summary()
    assert result.table.rel_diff.max() < 1e-5  # (fp32 reassociation; the default tolerance is 1e-3)
    total = math.sqrt(sum(p.grad.double().square().sum().item() for p in reference.parameters()))
    assert _value(result, "", "param_grad_norm").eager == pytest.approx(total, rel=1e-5)
    assert _value(result, "", "loss").eager == pytest.approx(ref_loss.item(), rel=1e-6)
    with torch.random.fork_rng():
        assert abs(_loss(ids)(copy.deepcopy(model).eval()(ids)).item() - ref_loss.item()) > 1e-3  # (dropout is on)
    assert all(p.grad is grads[p] for p in model.parameters())
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_hf_gpt2_compiled_agrees_with_eager_dropout_and_all():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=1,
                                                                 n_head=4)).train()
    ids = _ids()
    audited = ("act_norm", "act_grad_norm", "param_grad_norm", "attn_sink_mass", "attn_entropy")
    result = gradscope.compile_audit(model, ids, lambda out: _loss(ids)(out.logits), quantities=audited)
    assert result.passed, result.summary()
    assert {"forward", "backward", "parameter gradient", "other"} <= set(result.table.phase)
    assert set(result.table[result.table.phase == "other"].quantity) == {"attn_sink_mass", "attn_entropy"}
    assert len(result.table) > 10


def test_the_command_line_names_the_plant_and_writes_the_table_and_figure(tmp_path, capsys):
    status = main(["compile-audit", "--model", f"{__name__}:planted_net", "--out", str(tmp_path)])
    said = capsys.readouterr().out
    assert status == 1
    assert "first divergence: act_norm at 'blocks.1.out'" in said
    table = pd.read_parquet(tmp_path / "compile_audit.parquet")
    assert table[table.past].iloc[0].site == "blocks.1.out"
    assert (tmp_path / "compile_audit.png").stat().st_size > 0


@pytest.mark.parametrize("spec,says", [("no_colon", "package.module:factory"), ("no_such_module_x:f", "cannot import"),
                                       (f"{__name__}:missing", "has no attribute 'missing'")])
def test_the_command_line_refuses_a_bad_model_spec(spec, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compile-audit", "--model", spec])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_a_bad_tolerance_is_refused_by_name():
    with pytest.raises(ValueError, match="tolerance"):
        gradscope.compile_audit(Net(), _ids(), _loss(_ids()), tolerance=-1.0)


def test_a_model_compiled_in_place_is_refused_by_name():
    model = Net()
    model.blocks[0].compile()
    with pytest.raises(ValueError, match=r"\['blocks.0'\] were compiled in place"):
        gradscope.compile_audit(model, _ids(), _loss(_ids()))


def test_the_comparison_orders_forward_then_backward_reversed_and_flags_a_value_of_one_pass_only():
    from gradscope.compiled_vs_eager import _compare

    rows = [(0, "a.out", "act_norm", 1.0), (1, "a.out", "act_norm", 1.0), (0, "b.out", "act_norm", 2.0),
            (0, "a.out", "act_grad_norm", 3.0), (1, "a.out", "act_grad_norm", 3.0 * (1 + 2e-3)),
            (0, "b.out", "act_grad_norm", 0.0), (1, "b.out", "act_grad_norm", 0.0)]
    recorded = pd.DataFrame({"step": [r[0] for r in rows], "micro_step": -1, "site": [r[1] for r in rows],
                             "quantity": [r[2] for r in rows], "layer_j": pd.array([None] * len(rows), dtype="Int64"),
                             "role": "", "value": [r[3] for r in rows]})
    table = _compare(recorded, {"a.out": 0, "b.out": 1}, 1e-3)  # (a runs before b in the forward)
    assert list(zip(table.phase, table.site)) == [("forward", "a.out"), ("forward", "b.out"), ("backward", "b.out"),
                                                  ("backward", "a.out")]
    assert table.rel_diff.tolist() == pytest.approx([0.0, math.inf, 0.0, 2e-3 / (1 + 2e-3)])  # (both 0: no difference)
    assert table.past.tolist() == [False, True, False, True]
