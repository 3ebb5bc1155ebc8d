"""The analyses (``python -m analyses.<name>``): every one runs at ``--preset ci`` here, so CI
runs them; bad flags are argparse errors; the ``paper`` preset plans the papers' sizes."""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest
import torch

import gradscope
from gradscope import claims
from analyses import ANALYSES
from analyses import __main__ as run_all
from analyses.cli import make_parser
from analyses.runs import RunSpec
from gradscope.presets import PRESETS
from gradscope.table import SWEEP_COLUMNS

VERDICT_LINE = re.compile(r"^\[(holds|does not hold|inconclusive)\] (control: )?.+ \(preset ci\)", re.MULTILINE)
TRAINED = ("cosine", "dlcl_weights", "residual_shrink", "warmup_free", "convergence")


def module(name: str):
    return importlib.import_module(f"analyses.{name}")


def specs(name: str, preset: str) -> list[RunSpec]:
    return module(name).ANALYSIS(preset).plan()


@pytest.mark.parametrize("name", ANALYSES)
def test_analysis_runs_at_ci(name, tmp_path, capsys):
    assert module(name).main(["--preset", "ci", "--out", str(tmp_path), "--no-progress", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    lines = VERDICT_LINE.findall(printed)
    assert lines, printed

    png, pdf = (tmp_path / f"{name}.png").read_bytes(), (tmp_path / f"{name}.pdf").read_bytes()
    assert png.startswith(b"\x89PNG") and pdf.startswith(b"%PDF")
    table = gradscope.load(tmp_path / f"{name}.parquet")
    assert len(table) and set(table["run"]) == {s.run for s in specs(name, "ci")}

    claims_md = (tmp_path / "CLAIMS.md").read_text()
    section = claims_md.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| figure")]
    assert len(rows) == len(lines)
    assert all("| ci |" in r for r in rows)
    assert not list(tmp_path.glob(".*.tmp")), "atomic writes leave no temporary file"

    # --redraw: the same figure and CLAIMS.md from the saved table, which it leaves alone
    parquet = (tmp_path / f"{name}.parquet").read_bytes()
    (tmp_path / f"{name}.png").unlink()
    assert module(name).main(["--preset", "ci", "--out", str(tmp_path), "--redraw", "--device", "cpu"]) == 0
    assert (tmp_path / f"{name}.png").read_bytes() == png
    assert (tmp_path / "CLAIMS.md").read_text() == claims_md
    assert (tmp_path / f"{name}.parquet").read_bytes() == parquet
    with pytest.raises(SystemExit, match="pass the --preset and flags that table was made with"):
        module(name).main(["--preset", "default", "--out", str(tmp_path), "--redraw", "--device", "cpu"])

    if name == "convergence":
        import pandas as pd

        sweep = pd.read_parquet(tmp_path / "convergence_sweep.parquet")
        assert list(sweep.columns) == list(claims.SUMMARY_COLUMNS) and list(sweep.columns[:6]) == list(SWEEP_COLUMNS)
        assert len(sweep) == len(specs(name, "ci"))
    if name == "dlcl_weights":  # the figure states preset, step and masking on itself
        fig = module(name).ANALYSIS("ci").draw(table, [])
        words = " ".join([fig._suptitle.get_text(), *(t.get_text() for t in fig.texts),
                          *(ax.get_title() for ax in fig.axes)])
        assert "preset ci" in words and "|w| < 0.1" in words and "step 100" in words


BAD_FLAGS = [["--preset", "bogus"], ["--no-such-flag"], ["--threads", "0"], ["--device", "tpu"], ["--seed", "x"],
             *([["--device", "cuda"]] if not torch.cuda.is_available() else [])]


@pytest.mark.parametrize("name", [*ANALYSES, "__main__"])
@pytest.mark.parametrize("argv", BAD_FLAGS)
def test_bad_flags_exit_2(name, argv, capsys):
    with pytest.raises(SystemExit) as err:
        module(name).main(argv)
    assert err.value.code == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [(["--threads", "abc"], "--threads: must be an integer >= 1, got 'abc'"),
                                        (["--out", "FILE/sub"], "is not a folder")])
def test_bad_values_are_usage_errors_that_name_the_flag(argv, said, tmp_path, capsys):
    (tmp_path / "FILE").write_text("a file, not a folder")
    argv = [a.replace("FILE", str(tmp_path / "FILE")) for a in argv]
    with pytest.raises(SystemExit) as err:
        module("grad_norms").main(["--preset", "ci", *argv])
    assert err.value.code == 2
    assert said in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]  # nothing written


def test_every_flag_has_help():
    parser = make_parser("x", "")
    assert all(a.help for a in parser._actions)


@pytest.mark.parametrize("name", ANALYSES)
def test_paper_preset_plans_the_papers_sizes(name):
    plan = specs(name, "paper")
    assert plan
    for spec in plan:
        m = spec.model
        assert (m.d_model, m.n_heads, m.d_ff, m.dropout) == (512, 8, 2048, 0.1)
        if spec.train is not None:
            t = spec.train
            steps = module(name).WANG_STEPS["paper"] if name == "grad_norms" else 50_000  # (the first steps of a run)
            assert t.steps == steps and t.betas == (0.9, 0.98) and t.label_smoothing == 0.1
            assert t.warmup == (0 if name == "warmup_free" else 4000)  # Takase 2022 Table 7: 4k of 50k
    depths = {(s.model.n_enc, s.model.n_dec) for s in plan}
    expected = {"grad_norms": {(18, 18), (6, 6), (30, 6)}, "ln_locations": {(18, 18)},
                "residual_shrink": {(18, 18)}, "cosine": {(6, 6)}, "dlcl_weights": {(30, 6)},
                "warmup_free": {(6, 6)}, "convergence": {(18, 18), (24, 24), (6, 6)}, "lr_sensitivity": {(6, 6)},
                "spike_replay": {(6, 6)}, "moe_routing": {(6, 6)}}[name]
    assert expected <= depths


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", TRAINED)
def test_same_hyper_parameters_for_every_run(name, preset):
    plan = specs(name, preset)
    configs = {dataclasses.astuple(s.train.replace(seed=0)) for s in plan}
    assert len(configs) == 1
    seeds = sorted({s.train.seed for s in plan})  # the seeds differ, and only they
    expected = max(PRESETS[preset]().train_seeds, module(name).ANALYSIS.min_train_seeds)
    assert seeds == list(range(expected)) and all(s.seed == s.train.seed for s in plan)


def test_max_steps_caps_training():
    plan = module("dlcl_weights").ANALYSIS("paper", max_steps=20).plan()
    assert len(plan) == 3 and [s.run.rsplit(" · ", 1)[-1] for s in plan[1:]] == ["seed 1", "seed 2"]
    for spec in plan:
        assert spec.train.steps == 20 and spec.train.warmup == 2 and spec.train.eval_every == 2


def test_run_all_dry_run(tmp_path, capsys):
    out = tmp_path / "never"
    assert run_all.main(["--preset", "ci", "--out", str(out), "--dry-run", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert all(f"{name}:" in printed for name in ANALYSES)
    assert "all analyses:" in printed and "[dry-run]" in printed
    assert not out.exists()
