"""Faults, bad input and interruptions: nothing lost, every failure explained (issue 7)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

import gradscope
from gradscope.scan import summarize
from zoo_cases import batch, tiny

HERE = Path(__file__).parent


def loss_fn(model, inputs):
    logits = model(*inputs)
    return F.cross_entropy(logits.flatten(0, 1), ((inputs[-1] * 7 + 3) % model.config.vocab).flatten())


def site_module(model, name):
    return dict(model.named_modules())[name]


@pytest.mark.parametrize("site", ["decoder.layers.1.cross_attn.sum", "encoder.layers.0.ffn.norm.out"])
def test_nan_in_forward_is_named_first_and_recording_goes_on(site):
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("post_ln"))
    inject = site_module(model, site).register_forward_hook(lambda m, a, out: out * float("nan"))
    rec = gradscope.Recorder(model)
    with rec.step(0):
        loss_fn(model, batch(model.config)).backward()
    inject.remove()
    model.zero_grad()
    with rec.step(1):
        loss_fn(model, batch(model.config)).backward()
    df = rec.frame()
    bad = df[(df.step == 0) & (df.quantity == "nonfinite")].sort_values("value")
    assert bad.site.iloc[0] == site and bad.value.iloc[0] == 0
    assert not len(df[(df.step == 1) & df.quantity.isin(["nonfinite", "nonfinite_grad"])])
    assert math.isfinite(df[(df.step == 1) & (df.site == "") & (df.quantity == "param_grad_norm")].value.item())
    scan = summarize(df[df.step == 0])
    assert scan.nonfinite[0] == site
    assert any(site in line for line in scan.verdicts())


def test_inf_in_backward_is_named_first():
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    site = "decoder.layers.1.self_attn.branch"

    def poison(module, args, out):
        out.register_hook(lambda g: g * float("inf"))

    rec = gradscope.Recorder(model)  # its hooks come first: the poison reaches the value crossing the site
    inject = site_module(model, site).register_forward_hook(poison)
    with rec.step(0):
        loss_fn(model, batch(model.config)).backward()
    inject.remove()
    rec.close()
    df = rec.frame()
    assert not len(df[df.quantity == "nonfinite"])  # the forward pass was clean
    bad = df[df.quantity == "nonfinite_grad"].sort_values("value")
    assert bad.site.iloc[0] == site
    assert summarize(df).nonfinite[0] == site


def test_killed_run_resumes_to_the_same_parameters_and_table(tmp_path):
    steps, kill_after = 14, 9
    child = [sys.executable, str(HERE / "interrupt_child.py")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    subprocess.run([*child, str(straight), str(steps)], check=True, env=env, capture_output=True, timeout=300)
    proc = subprocess.Popen([*child, str(interrupted), str(steps)], env=env, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.strip() == f"step {kill_after}":
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (interrupted / "params.pt").exists()
    assert not list((interrupted / "ckpt").glob("*.tmp")) and not list((interrupted / "ckpt").glob(".*"))
    resumed = subprocess.run([*child, str(interrupted), str(steps)], check=True, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.stdout.splitlines()[0] == "step 9"  # continued after the step-8 checkpoint
    a = torch.load(straight / "params.pt", weights_only=True)
    b = torch.load(interrupted / "params.pt", weights_only=True)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    rec_a, rec_b = gradscope.load(straight / "record.parquet"), gradscope.load(interrupted / "record.parquet")
    pd.testing.assert_frame_equal(rec_a, rec_b)
    counts = rec_b[(rec_b.quantity == "act_grad_norm") & (rec_b.site == "decoder.layers.0.out")].groupby("step").size()
    assert list(counts.index) == list(range(1, steps + 1)) and set(counts) == {1}
    pd.testing.assert_frame_equal(gradscope.load(straight / "history.parquet"), gradscope.load(interrupted / "history.parquet"))


def test_load_rejects_truncated_and_foreign_files(tmp_path):
    model = gradscope.build_model(tiny("post_ln"))
    with gradscope.record(model) as rec:
        loss_fn(model, batch(model.config)).backward()
    good = tmp_path / "good.parquet"
    rec.save(good)
    assert len(gradscope.load(good)) == len(rec.frame())
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ValueError, match="truncated.parquet.*not a readable parquet"):
        gradscope.load(truncated)
    foreign = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"a": [1, 2]}), foreign)
    with pytest.raises(ValueError, match="foreign.parquet.*not a gradscope table"):
        gradscope.load(foreign)
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        gradscope.load(tmp_path / "missing.parquet")


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    model = gradscope.build_model(tiny("post_ln"))
    with gradscope.record(model) as rec:
        loss_fn(model, batch(model.config)).backward()
    path = tmp_path / "record.parquet"
    rec.save(path)
    before = path.read_bytes()

    def broken_write(table, where, *a, **k):
        Path(where).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", broken_write)
    with pytest.raises(OSError, match="disk full"):
        rec.save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["record.parquet"]


def test_model_without_sites_blocks_or_norms_explains_itself():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError) as err:
        gradscope.Recorder(model)
    message = str(err.value)
    for words in ("Sequential", "repeated blocks", "LayerNorm", "gradscope.Site"):
        assert words in message


def test_user_sites_make_any_model_recordable():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.hook_hidden = gradscope.Site()

        def forward(self, x):
            return self.hook_hidden(self.fc(x)).sum()

    model = Tiny()
    with gradscope.record(model) as rec:
        model(torch.randn(3, 4)).backward()
    rows = rec.frame()
    assert rows[rows.quantity == "act_grad_norm"].site.tolist() == ["hook_hidden"]
    assert rows[rows.quantity == "act_grad_norm"].value.item() == pytest.approx(math.sqrt(12))


def test_unknown_quantities_and_site_patterns_list_valid_ones():
    model = gradscope.build_model(tiny("post_ln"))
    with pytest.raises(ValueError, match=r"quantities: unknown \['grad_nrom'\]; valid: .*act_grad_norm"):
        gradscope.Recorder(model, quantities=["grad_nrom"])
    with pytest.raises(ValueError, match="quantities: unknown preset 'everything'"):
        gradscope.Recorder(model, quantities="everything")
    presets = r"\['all', 'default', 'moe', 'outliers', 'signals', 'weights'\]"
    with pytest.raises(ValueError, match=rf"quantities: a preset {presets} or a list .*; got None"):
        gradscope.Recorder(model, quantities=None)
    with pytest.raises(ValueError, match=r"sites: pattern 'decoder.layer.\*' matches no site; closest: \['decoder.layers"):
        gradscope.Recorder(model, sites=["decoder.layer.*"])
    with pytest.raises(ValueError, match="every: must be an integer >= 1"):
        gradscope.Recorder(model, every=0)
    rec = gradscope.Recorder(model, sites=["decoder.layers.?.out"])  # fnmatch: * would also cross dots
    assert rec.site_names == [f"decoder.layers.{i}.out" for i in range(3)]


@pytest.mark.parametrize("argv", [["scan", "--variant", "postln"], ["scan", "--n-enc", "0"], ["scan", "--bogus"], ["nothing"]])
def test_cli_rejects_bad_flags_with_exit_2(argv, capsys):
    from gradscope.__main__ import main

    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert "error:" in capsys.readouterr().err
