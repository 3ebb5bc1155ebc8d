"""Under gradient accumulation, the table gives the step's value (issue 50): ``rec.frame()``,
``gradscope.load`` and the recipes of the README and docs/table.md select one row per step
and point, the accumulated step's, which equals √Σ_m ‖g_m‖² computed here with autograd
per micro-batch; the micro-batches' rows come only when asked for."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

import gradscope
from recorder_ref import site_gradients

ROOT = Path(__file__).resolve().parents[1]
MICRO = 2
STEPS = 2


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=50)
    return transformers.LlamaForCausalLM(config)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, 50, (2, 8), generator=g) for _ in range(MICRO)] for _ in range(STEPS)]


def _recorded(log_dir=None):
    """Two steps of two micro-batches each, recorded; and the reference: per step and layer
    output site, √Σ_m ‖∂loss_m/∂h‖² from autograd on an unrecorded copy with the same weights."""
    model = _llama()
    twin = _llama()
    twin.load_state_dict(model.state_dict())
    rec = gradscope.Recorder(model, log_dir=log_dir)
    modules = dict(twin.named_modules())  # (the twin's modules at the same names)
    sites = {p.name: (modules[p.name.removesuffix(".out")], p.where) for p in rec.layout.sites if p.role == "layer_out"}
    expected = {}
    for step, micro in enumerate(_batches()):
        with rec.step(step):
            for ids in micro:
                (model(input_ids=ids, labels=ids).loss / MICRO).backward()
        squares = {}
        for ids in micro:
            grads, _ = site_gradients(twin, sites, lambda ids=ids: twin(input_ids=ids, labels=ids).loss / MICRO)
            for site, g in grads.items():
                squares[site] = squares.get(site, 0.0) + g * g
        expected.update({(step, site): math.sqrt(sq) for site, sq in squares.items()})
    rec.close()
    return rec, sites, expected


def _layer_of(rec, site):
    return next(p.layer for p in rec.layout.sites if p.name == site)


def test_frame_load_and_the_readme_recipe_give_the_step_value(tmp_path):
    rec, sites, expected = _recorded(log_dir=tmp_path / "run")
    for df in (rec.frame(), gradscope.load(tmp_path / "run")):
        assert (df.micro_step == -1).all()  # one row per step and point
        readme = re.search(r'out = df\[(.*?)\]\nprint\(out\.(pivot_table\(.*?\))\)', (ROOT / "README.md").read_text())
        out = df[eval(readme[1], {"df": df})]  # the README's own selection and pivot
        table = eval(f"out.{readme[2]}", {"out": out})
        for (step, site), value in expected.items():
            got = table.loc[_layer_of(rec, site), step]
            assert abs(got - value) <= 1e-5 * value, (step, site, got, value)
    micro = rec.frame(micro_steps=True)
    assert sorted(micro.micro_step.unique()) == [-1, 0, 1]
    loaded = gradscope.load(tmp_path / "run", micro_steps=True)
    assert sorted(loaded.micro_step.unique()) == [-1, 0, 1]
    pd.testing.assert_frame_equal(micro.sort_values(list(micro.columns)).reset_index(drop=True),
                                  loaded.sort_values(list(loaded.columns)).reset_index(drop=True))


def test_the_docs_selections_give_one_value_per_point_and_the_step_value(tmp_path):
    rec, sites, expected = _recorded()
    path = tmp_path / "t.parquet"
    rec.save(path)  # every row, micro-batches' too
    assert (gradscope.load(path, micro_steps=True).micro_step >= 0).any()
    block = re.search(r"## Selecting\n\n```python\n(.*?)```", (ROOT / "docs/table.md").read_text(), re.S)[1]
    for df in (rec.frame(), gradscope.load(path)):
        scope = {"df": df.assign(stack=df["stack"].replace({"model.layers": "decoder"}))}  # (the docs' stack name)
        exec(block, scope)
        ln = df[df.quantity == "ln_gain"]
        assert len(scope["gains"]) == ln.groupby(["step", "site"]).ngroups > 0  # one per norm and step
        assert len(scope["total"]) == STEPS  # the global gradient norm: one row per step
        for (step, site), value in expected.items():
            got = scope["profile"].loc[_layer_of(rec, site), step]
            assert abs(got - value) <= 1e-5 * value, (step, site, got, value)


def test_nonfinite_has_the_step_rows_under_accumulation():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 1))
    rec = gradscope.Recorder(model, quantities=["nonfinite"])
    with rec.step(0):
        model(torch.randn(3, 4)).sum().backward()
        model(torch.full((3, 4), float("nan"))).sum().backward()
    rec.close()
    step = rec.frame()
    assert not step.empty and (step.micro_step == -1).all()
    micro = rec.frame(micro_steps=True)
    first = micro[(micro.micro_step == 1) & (micro.quantity == "nonfinite")].sort_values("value")
    ours = step[step.quantity == "nonfinite"].sort_values("value")
    assert ours.site.tolist() == first.site.tolist()  # the NaN came in micro-step 1 only: its order
