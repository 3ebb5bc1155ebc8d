"""A site that backward did not reach has no gradient row, not 0.0; a site whose gradient
is zero has a 0.0 row. The capture counts each gradient's arrival, so the two are told
apart. References: autograd on a copy of the model, with the same backward."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import gradscope


class Block(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class Net(nn.Module):
    """Three residual blocks; with ``dead``, the last one's output counts zero times."""

    def __init__(self, dead: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.dead = dead

    def forward(self, x):
        x = self.blocks[1](self.blocks[0](x))
        return x + 0 * self.blocks[2](x) if self.dead else self.blocks[2](x)


SITES = {"blocks.0.out": "blocks.0", "blocks.1.out": "blocks.1", "blocks.2.out": "blocks.2"}


def _reference(model, x, backwards) -> list[dict[str, float]]:
    """Per backward: ‖∂loss/∂(module output)‖ by retain_grad on a copy (absent: not reached)."""
    twin = copy.deepcopy(model)
    kept: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, args, out):
            out = out.view_as(out)
            out.retain_grad()
            kept[name] = out
            return out
        return hook

    handles = [twin.get_submodule(m).register_forward_hook(keep(s)) for s, m in SITES.items()]
    out = []
    for inputs in backwards:
        loss = twin(x).square().mean()
        loss.backward(inputs=None if inputs is None else [twin.get_parameter(n) for n in inputs])
        out.append({s: t.grad.norm().item() for s, t in kept.items() if t.grad is not None})
    for h in handles:
        h.remove()
    return out


def _rows(rec) -> dict[tuple[int, str], float]:
    df = rec.frame(micro_steps=True).query("quantity == 'act_grad_norm' and site in @SITES")
    return {(m, s): v for m, s, v in zip(df.micro_step, df.site, df.value)}


def test_a_zero_gradient_is_a_row_of_zero():
    torch.manual_seed(0)
    model, x = Net(dead=True), torch.randn(2, 5, 8)
    (want,) = _reference(model, x, [None])
    assert want["blocks.2.out"] == 0.0 and want["blocks.1.out"] > 0 and len(want) == 3
    rec = gradscope.Recorder(model)
    with rec.step(0):
        model(x).square().mean().backward()
    got = _rows(rec)
    assert got[(-1, "blocks.2.out")] == 0.0
    for site, value in want.items():
        assert got[(-1, site)] == pytest.approx(value, rel=1e-5), site
    rec.close()


def test_sites_a_backward_did_not_reach_have_no_rows_and_are_named():
    """Micro-step 0 reaches every site; micro-step 1's backward stops at block 2."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 5, 8)
    backwards = [None, ["blocks.2.fc.weight"]]
    want = _reference(model, x, backwards)
    assert set(want[1]) == {"blocks.2.out"}  # the second backward reached one of the three sites
    rec = gradscope.Recorder(model)
    with pytest.warns(UserWarning, match=r"blocks\.0\.out.*did not reach them.*no rows, not 0\.0"):
        with rec.step(0):
            for inputs in backwards:
                loss = model(x).square().mean()
                loss.backward(inputs=None if inputs is None else [model.get_parameter(n) for n in inputs])
    got = _rows(rec)
    assert {s for m, s in got if m == 1} == {"blocks.2.out"}, "a row for a site the backward did not reach"
    for m in (0, 1):
        for site, value in want[m].items():
            assert got[(m, site)] == pytest.approx(value, rel=1e-5), (m, site)
    for site in SITES:  # the step's row sums the backwards that reached the site
        total = sum(w.get(site, 0.0) ** 2 for w in want) ** 0.5
        assert got[(-1, site)] == pytest.approx(total, rel=1e-5), site
    rec.close()


def test_compiled_a_backward_limited_by_inputs_gives_no_gradient_rows_and_says_why():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 5, 8)
    rec = gradscope.Recorder(model)
    run = torch.compile(model, fullgraph=True)
    with pytest.warns(UserWarning, match=r"compiled.*inputs="):
        with rec.step(0):
            run(x).square().mean().backward(inputs=[model.blocks[2].fc.weight])
    df = rec.frame()
    assert not {"act_grad_norm", "ln_gain", "param_grad_norm"} & set(df.quantity)
    (want,) = _reference(model, x, [None])  # a full backward, compiled, gives autograd's numbers again
    with rec.step(1):
        run(x).square().mean().backward()
    got = rec.frame().query("step == 1 and quantity == 'act_grad_norm'").set_index("site").value
    for site, value in want.items():
        assert got[site] == pytest.approx(value, rel=1e-5, abs=1e-12), site
    rec.close()


def _gradscope_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("gradscope")]


def test_a_backward_that_reaches_no_site_is_not_taken_for_one_that_did_not_run():
    """``inputs=`` after the last site: alone, the step says a backward may have stopped before
    every site; after a full backward, that it saw fewer backwards than forwards."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 5, 8)
    head = nn.Linear(8, 8)
    rec = gradscope.Recorder(model)
    with pytest.warns(UserWarning, match=r"no backward inside it reached the recorder's sites.*inputs="):
        with rec.step(0):
            head(model(x)).square().mean().backward(inputs=[head.weight])
    with pytest.warns(UserWarning, match=r"ran 2 forwards with grad enabled and the recorder saw 1 backward"):
        with rec.step(1):
            head(model(x)).square().mean().backward()
            head(model(x)).square().mean().backward(inputs=[head.weight])
    rec.close()


def test_one_backward_per_micro_step_gives_no_warning_about_backwards():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 5, 8)
    rec = gradscope.Recorder(model)
    with pytest.warns(UserWarning) as record:  # (the model's input needs no grad: that warning is expected)
        with rec.step(0):
            for _ in range(3):
                model(x).square().mean().backward()
    assert not [m for m in _gradscope_warnings(record) if "backward" in m and "did not require grad" not in m]
    assert set(rec.frame(micro_steps=True).query("quantity == 'act_grad_norm'").micro_step) == {-1, 0, 1, 2}
    rec.close()


def test_the_warning_names_the_call_of_a_shared_module_that_backward_did_not_reach():
    class Shared(Net):
        def forward(self, x):
            x = self.blocks[0](x)
            y = self.blocks[1](x)
            self.blocks[1](x * 2)  # the second call feeds nothing
            return self.blocks[2](y)

    torch.manual_seed(0)
    model, x = Shared(), torch.randn(2, 5, 8)
    rec = gradscope.Recorder(model)
    with pytest.warns(UserWarning, match=r"\['blocks\.1\.in#2', 'blocks\.1\.ln\.in#2', 'blocks\.1\.ln\.out#2', "
                                         r"'blocks\.1\.out#2'\] were called with grad enabled, but a backward"):
        with rec.step(0):
            model(x).square().mean().backward()
    sites = set(rec.frame().query("quantity == 'act_grad_norm'").site)
    assert "blocks.1.out" in sites and "blocks.1.out#2" not in sites
    rec.close()


def test_blocks_compiled_one_by_one_and_a_backward_given_inputs_name_the_compiled_sites():
    """torchtitan style: each block compiled. The sites inside a block are captured in its
    graph; the block's own input and output run its hooks eagerly (outside the compiled
    forward). A backward given ``inputs=`` reaches the eager sites it passes, not the
    compiled capture: the sites inside the blocks are named as compiled, the eager sites it
    did not pass as not reached, and the eager rows equal autograd."""
    class Normed(Net):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(super().forward(x))

    torch.manual_seed(0)
    model, x = Normed(), torch.randn(2, 5, 8)
    twin = copy.deepcopy(model)
    kept = {}

    def keep(module, args):
        kept["norm.in"] = args[0].view_as(args[0])
        kept["norm.in"].retain_grad()
        return (kept["norm.in"],)

    twin.norm.register_forward_pre_hook(keep)
    probe = torch.randn(2, 5, 8)  # (not a sum of squares: through a LayerNorm that gradient cancels to rounding)
    (twin(x) * probe).sum().backward(inputs=[twin.blocks[2].fc.weight])
    rec = gradscope.Recorder(model)
    for block in model.blocks:
        block.compile(fullgraph=True)
    with pytest.warns(UserWarning) as record, rec.step(0):
        (model(x) * probe).sum().backward(inputs=[model.blocks[2].fc.weight])
    said = _gradscope_warnings(record)
    assert any("'blocks.0.ln.out'" in m and "ran compiled" in m for m in said), said
    assert any("'blocks.0.out'" in m and "did not reach them" in m for m in said), said
    assert not any("'blocks.2.out'" in m for m in said), said
    got = rec.frame().query("quantity == 'act_grad_norm'").set_index("site").value
    assert "blocks.0.out" not in got and "blocks.0.ln.out" not in got
    assert got["norm.in"] == pytest.approx(kept["norm.in"].grad.norm().item(), rel=1e-5)
    assert got["blocks.2.out"] == pytest.approx(kept["norm.in"].grad.norm().item(), rel=1e-5)  # the same tensor
    rec.close()


def test_an_evaluation_step_under_no_grad_records_values_and_says_nothing_of_backward():
    """A recorded evaluation step (``torch.no_grad``, PyTorch's fused encoder fast path) with
    every quantity: a norm's w/σ mark is not taken for a gradient the step expected, so no
    warning asks for a backward; the layer outputs' norms equal hooks of the test's own."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 16)
    outs = []
    handles = [m.register_forward_hook(lambda m, a, o: outs.append(o.norm().item())) for m in model.layers]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    rec = gradscope.Recorder(model, quantities="all")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch.no_grad(), rec.step(0):
            model(x)
        frame = rec.frame()
    assert not [w for w in _gradscope_warnings(record) if "backward" in w]
    got = frame[(frame.quantity == "act_norm") & (frame.role == "layer_out")].sort_values("layer").value.tolist()
    assert got == pytest.approx(outs, rel=1e-6)
    assert frame[frame.quantity == "act_grad_norm"].empty
    rec.close()
