"""What a recorded step reuses from the step before: the row keys (made once, found by
identity in the row store), the squared-norm plan of the last list of that length, and
LayerNorm gains computed for every norm at once. Each shortcut must give what the long
way gives, and must not be taken when it would be wrong."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gradscope
from gradscope.recorder.numerics import squared_norms as sqnorm
from gradscope.table.keys import Key
from gradscope.table.rows import RowStore


def _key(site: str, quantity: str = "act_norm") -> Key:
    return Key(-1, "encoder", 0, site, quantity, None, "")


def test_the_row_store_maps_reused_and_new_keys_to_the_right_rows():
    store = RowStore()
    a, b, c = _key("a"), _key("b"), _key("c")
    store.append(0, [a, b], np.array([1.0, 2.0]))
    store.append(1, [a, b], np.array([3.0, 4.0]))  # the very same objects: ids reused
    store.append(2, [a, _key("c")], np.array([5.0, 6.0]))  # same length, a new key in second place
    store.append(3, [_key("b"), c, a], np.array([7.0, 8.0, 9.0]))  # equal keys, new objects, other length
    df = store.frame(run="r", variant="v", rank=0, reduction="")
    got = {(int(s), site): v for s, site, v in zip(df.step, df.site, df.value)}
    assert got == {(0, "a"): 1.0, (0, "b"): 2.0, (1, "a"): 3.0, (1, "b"): 4.0, (2, "a"): 5.0, (2, "c"): 6.0,
                   (3, "b"): 7.0, (3, "c"): 8.0, (3, "a"): 9.0}


def test_the_row_store_forgets_reused_ids_when_loaded_from_a_state():
    first, second = RowStore(), RowStore()
    a, b = _key("a"), _key("b")
    first.append(0, [b], np.array([1.0]))
    second.append(0, [a], np.array([2.0]))
    second.load_state_dict(first.state_dict())  # ids now mean first's keys: b is 0
    second.append(1, [a], np.array([3.0]))  # a: the same object as second's last append, a new id now
    df = second.frame(run="r", variant="v", rank=0, reduction="")
    assert sorted(zip(df.step.tolist(), df.site.tolist(), df.value.tolist())) == [(0, "b", 1.0), (1, "a", 3.0)]


def test_the_last_plan_is_not_reused_for_other_dtypes():
    shapes = [(3, 4), (5,), (4, 4), (2,)]
    g = torch.Generator().manual_seed(0)
    f32 = [torch.randn(s, generator=g) for s in shapes]
    f64 = [t.double() * 3 for t in f32]
    for tensors in (f32, f64, f32):  # same length and shapes each time: only the dtype tells them apart
        got = sqnorm.fp64_squared_norms(tensors)
        want = torch.stack([t.double().square().sum() for t in tensors])
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_ln_gain_of_every_norm_at_once_matches_autograd(micro_batches):
    """One micro-step takes the every-norm-at-once path; three take the per-norm loop. Both
    against ‖∂L/∂x through the norm alone‖ / ‖∂L/∂y‖ from autograd, computed here."""
    torch.manual_seed(0)
    norms = torch.nn.ModuleList([torch.nn.LayerNorm(8) for _ in range(3)])
    lins = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norms, self.lins = norms, lins

        def forward(self, x):
            for n, lin in zip(self.norms, self.lins):
                x = x + lin(n(x))
            return x

    model = Net()
    rec = gradscope.Recorder(model, quantities=["ln_gain"])
    xs = [torch.randn(2, 5, 8) for _ in range(micro_batches)]
    with rec.step(0):
        for x in xs:
            model(x).square().mean().backward()
    rec.close()
    df = rec.frame()
    rows = df[(df.quantity == "ln_gain") & (df.micro_step == -1)].set_index("site").value
    # the reference: gradients at each norm's input (through it alone) and output, summed over micro-batches
    sq_in, sq_out = np.zeros(3), np.zeros(3)
    for x in xs:
        h = x.clone().requires_grad_()
        ins, ys = [], []
        for n, lin in zip(norms, lins):
            ins.append(h)
            ys.append(n(h))
            h = h + lin(ys[-1])
        gy = torch.autograd.grad(h.square().mean(), ys, retain_graph=True)  # ∂L/∂y, every path
        for i, g in enumerate(gy):
            gx, = torch.autograd.grad(ys[i], ins[i], g, retain_graph=True)  # through norm i alone
            sq_in[i] += float(gx.double().square().sum())
            sq_out[i] += float(g.double().square().sum())
    assert sorted(rows.index) == ["norms.1", "norms.2"]  # (norms.0's input is the model's: no site there)
    for name in rows.index:
        i = int(name.split(".")[1])
        want = math.sqrt(sq_in[i]) / math.sqrt(sq_out[i])
        assert rows[name] == pytest.approx(want, rel=1e-5)


def test_sites_a_branch_skips_on_some_steps_get_rows_only_when_called():
    """Kept keys are per set of called slots: a step that skips a block has no rows for its
    sites, and the next step that calls it has them again, with the values of its own
    forward (‖h‖ from a hook of the test's own, ‖∂L/∂h‖ from autograd)."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(3))

        def forward(self, x, skip_b):
            for i, block in enumerate(self.blocks):
                if not (skip_b and i == 1):
                    x = block(x)
            return x

    model = Net()
    seen: dict[str, torch.Tensor] = {}
    for i, block in enumerate(model.blocks):
        def keep(module, args, out, name=f"blocks.{i}.out"):
            out.retain_grad()
            seen[name] = out
        block.register_forward_hook(keep)
    rec = gradscope.Recorder(model, quantities=["act_norm", "act_grad_norm"])
    expected = {}
    plan = [False, True, False, False, True, True, False]
    for step, skip_b in enumerate(plan):
        seen.clear()
        with rec.step(step):
            model(torch.randn(3, 6), skip_b).square().sum().backward()
        for name, out in seen.items():
            expected[(step, name, "act_norm")] = float(out.detach().double().norm())
            expected[(step, name, "act_grad_norm")] = float(out.grad.double().norm())
    rec.close()
    df = rec.frame()
    got = {(int(s), site, q): v for s, site, q, v in zip(df.step, df.site, df.quantity, df.value)
           if site.endswith(".out")}
    assert set(got) == set(expected)
    skipped = {step for step, skip_b in enumerate(plan) if skip_b}
    assert not any(int(s) in skipped for s in df.step[df.site.str.startswith("blocks.1.")])
    for k, want in expected.items():
        assert got[k] == pytest.approx(want, rel=1e-5), k
