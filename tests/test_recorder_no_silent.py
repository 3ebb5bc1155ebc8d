"""No silent wrong numbers (issue 23): a step whose backward did not run inside it, a step
index recorded twice, a run resumed into its own log_dir. References are computed here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import gradscope

HERE = Path(__file__).parent
KEY = ["run", "rank", "step", "micro_step", "stack", "layer", "site", "quantity", "layer_j"]
GRADIENT_QUANTITIES = {"act_grad_norm", "ln_gain", "param_grad_norm"}


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class Net(nn.Module):
    def __init__(self, d: int = 8, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(depth)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("compiled", [False, True])
def test_a_step_whose_backward_ran_after_it_has_no_gradient_rows_and_warns(compiled):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 5, 8)
    rec = gradscope.Recorder(model)
    run = torch.compile(model, fullgraph=True) if compiled else model
    with pytest.warns(UserWarning, match=r"no backward inside it reached the recorder.s sites.*loss\.backward\(\) inside"):
        with rec.step(0):
            loss = run(x).square().mean()
            rec.log("loss", loss)
        loss.backward()  # too late: after the block
    df = rec.frame()
    assert not GRADIENT_QUANTITIES & set(df.quantity), "a gradient row for a step that saw no backward"
    assert {"act_norm", "loss"} <= set(df.quantity)
    assert not (df.value == 0).any()
    # the next step, done right, records the gradient autograd gives: loss = mean(out²), so
    # ∂loss/∂out = 2·out/N at the last block's output
    model.zero_grad()
    with rec.step(1):
        run(x).square().mean().backward()
    with torch.no_grad():
        out = model(x)
    want = (2 * out / out.numel()).double().norm().item()
    df = rec.frame()
    got = df[(df.step == 1) & (df.quantity == "act_grad_norm") & (df.site == "blocks.2.out")].value
    assert got.item() == pytest.approx(want, rel=1e-5)
    assert GRADIENT_QUANTITIES <= set(df[df.step == 1].quantity)
    rec.close()


def test_a_step_without_any_gradient_recorded_under_no_grad_does_not_warn():
    model = Net()
    rec = gradscope.Recorder(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad(), rec.step(0):
            model(torch.randn(2, 3, 8))
    assert set(rec.frame().quantity) == {"act_norm"}


def test_a_step_index_recorded_twice_warns():
    model, x = Net(), torch.randn(2, 3, 8)
    rec = gradscope.Recorder(model)
    for step in (0, 1):
        with rec.step(step):
            model(x).sum().backward()
    with pytest.warns(UserWarning, match="step 1 recorded after step 1"):
        with rec.step(1):
            model(x).sum().backward()


def _run_child(out: Path, steps: int, ckpt: int, *extra, kill_at: int | None = None) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    child = subprocess.Popen([sys.executable, str(HERE / "resume_child.py"), str(out), str(steps), str(ckpt), *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        for line in child.stdout:
            lines.append(line.strip())
            if kill_at is not None and line.strip() == f"step {kill_at}":
                child.send_signal(signal.SIGKILL)
                break
        _, err = child.communicate(timeout=120)
    finally:
        child.kill()
    if kill_at is None:
        assert child.returncode == 0, err
    else:
        assert child.returncode == -signal.SIGKILL, err
    return lines + err.splitlines()


def test_a_run_killed_and_resumed_from_a_checkpoint_loads_each_step_once(tmp_path):
    """Killed at step 9 (steps 0-7 flushed, checkpoint after step 4), resumed from step 5 to
    12: steps 5-7 are written twice; the load holds each once, the resumed run's."""
    _run_child(tmp_path, 100, 4, kill_at=9)
    first = gradscope.load(tmp_path / "run")
    assert sorted(first.step.unique()) == list(range(8))  # flush_every=2: whole parts up to step 7
    err = _run_child(tmp_path, 12, 4, "--resume")
    assert any("step 5 is already in" in line for line in err), "no warning that the resumed run rewrites steps"
    df = gradscope.load(tmp_path / "run")
    assert sorted(df.step.unique()) == list(range(12))
    assert not df.duplicated(KEY).any(), df[df.duplicated(KEY, keep=False)].sort_values(KEY).head()
    per_step = df.groupby("step").quantity.value_counts().unstack(fill_value=0)
    assert (per_step.loss == 1).all() and (per_step.act_grad_norm == per_step.act_grad_norm.iloc[0]).all()
    # the resumed run's frame() is what load gives (the earlier run's parts in its folder, then
    # its own); steps 5-7 are the resumed run's (it drew other batches, so its values differ)
    resumed = gradscope.load(tmp_path / "resumed.parquet")
    both = df.merge(resumed, on=KEY, suffixes=("", "_resumed"))
    assert len(both) == len(df) == len(resumed)
    assert (both.value == both.value_resumed).all()
    killed = first[first.step.between(5, 7)].merge(resumed, on=KEY, suffixes=("", "_resumed"))
    assert (killed.quantity == "loss").any() and (killed.value != killed.value_resumed).any()


def test_qwen3_per_head_norms_do_not_hide_the_cosine_stack():
    """Qwen3's blocks hold per-head q_norm/k_norm (width head_dim) besides the residual
    stream's norms: the stack's width is the widest norm's, so cosine rows exist, and
    equal an explicit loop over the layer outputs' cosines (every token taken)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=32)
    model, ids = transformers.Qwen3ForCausalLM(cfg), torch.randint(0, 64, (2, 8))
    outs = []
    hooks = [layer.register_forward_hook(lambda m, a, kw, o: outs.append(o[0] if isinstance(o, tuple) else o), with_kwargs=True)
             for layer in model.model.layers]
    hooks.append(model.model.layers[0].register_forward_pre_hook(
        lambda m, a, kw: outs.insert(0, kw.get("hidden_states", a[0] if a else None)), with_kwargs=True))
    with gradscope.record(model, quantities=["cosine"], slow_every=1, options=gradscope.RecorderOptions(cosine_tokens=10_000)) as rec:
        model(input_ids=ids, labels=ids).loss.backward()
    for h in hooks:
        h.remove()
    df = rec.frame()
    cos = df[df.quantity == "cosine"]
    assert len(cos) == 9, "no cosine rows: the stack's width was taken from a per-head norm"
    y = [o.detach().reshape(-1, 32).double() for o in outs]
    want = torch.nn.functional.cosine_similarity(y[0], y[2], dim=-1).mean().item()
    got = cos[(cos.layer == 0) & (cos.layer_j == 2)].value.item()
    assert got == pytest.approx(want, rel=1e-5)


def test_a_stack_that_changes_width_warns_instead_of_a_silent_gap():
    pytest.importorskip("transformers")
    from published_rules import build

    model, run = build("wav2vec2_stable")  # a convolutional feature encoder: a stack whose outputs change shape
    with pytest.warns(UserWarning, match=r"no cosine rows for stack\(s\) \['wav2vec2.feature_extractor.conv_layers'\]"):
        with gradscope.record(model, quantities="all", slow_every=1) as rec:
            run().backward()
    assert (rec.frame().quantity == "cosine").any()  # the encoder's own stack still has its rows


@pytest.mark.parametrize("logged", [None, "inside", "after"])
@pytest.mark.parametrize("steps", [1, 2])
def test_lr_asked_for_without_an_optimizer_warns_unless_logged(logged, steps):
    """``lr`` named in ``quantities`` with no optimizer and no ``rec.log("lr", ...)`` has no
    rows: a warning says why (it was silent, while update_ratio and grad_rms_over_eps warn);
    a value logged inside the step or after it (``step=``) has rows, and no warning."""
    model = Net()
    rec = gradscope.Recorder(model, quantities=["lr", "param_grad_norm"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            with rec.step(step):
                model(torch.randn(2, 3, 8)).square().mean().backward()
                if logged == "inside":
                    rec.log("lr", 0.1)
            if logged == "after":
                rec.log("lr", 0.1, step=step)
        rec.close()
    said = [str(w.message) for w in caught if "lr is read from the optimizer" in str(w.message)]
    lr = rec.frame().query("quantity == 'lr'")
    if logged:
        assert not said and lr.value.tolist() == [0.1] * steps
    else:
        assert len(said) == 1 and lr.empty
