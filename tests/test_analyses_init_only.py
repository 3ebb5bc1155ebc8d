"""``--batch-size`` and ``--init-only``: the paper preset's at-init analyses on a CPU (issue 13),
checked here at ``--preset ci``."""

from __future__ import annotations

import pandas as pd
import pytest

import gradscope
from analyses import residual_shrink, scan_agreement
from analyses import __main__ as run_all
from analyses.grad_norms import GradNorms
from analyses.residual_shrink import ResidualShrink

ARGS = ["--preset", "ci", "--no-progress", "--device", "cpu"]


def claims_rows(out, name: str) -> list[str]:
    section = (out / "CLAIMS.md").read_text().split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
    return [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| figure")]


def test_batch_size_changes_the_batch_only():
    analysis = GradNorms("ci", batch_size=4)
    assert analysis.preset.batch_size == 4 and analysis.preset_batch_size == 16 and analysis.batch_reduced
    assert analysis.preset.size == GradNorms("ci").preset.size  # width and depth untouched
    assert not GradNorms("ci", batch_size=16).batch_reduced and GradNorms("ci").setting_notes() == []


def test_residual_shrink_init_only_with_a_smaller_batch(tmp_path, capsys):
    assert residual_shrink.main([*ARGS, "--out", str(tmp_path), "--init-only", "--batch-size", "4"]) == 0
    table = gradscope.load(tmp_path / "residual_shrink.parquet")
    assert set(table["step"]) == {0} and "val_loss" not in set(table["quantity"])  # nothing trained
    rows = claims_rows(tmp_path, "residual_shrink")
    assert len(rows) == 2 and all("at init" in r and "| ci |" in r for r in rows)
    assert all("batch 4 instead of the preset's 16" in r and "--init-only" in r for r in rows)
    fig = ResidualShrink("ci", batch_size=4, init_only=True).draw(table, [])
    footer = " ".join(t.get_text() for t in fig.texts)
    assert "batch 4 (reduced from the preset's 16 with --batch-size)" in footer and "--init-only" in footer


def test_init_only_is_refused_where_claims_need_training(tmp_path):
    from analyses import cosine

    with pytest.raises(SystemExit, match="--init-only is not supported"):
        cosine.main([*ARGS, "--out", str(tmp_path), "--init-only"])


def test_scan_init_only_needs_no_sweep(tmp_path, capsys):
    assert scan_agreement.main([*ARGS, "--out", str(tmp_path), "--init-only", "--batch-size", "4"]) == 0
    table = pd.read_parquet(tmp_path / "scan_agreement.parquet")
    assert "outcome" not in table and set(table.scan) <= {"healthy", "at risk"}
    text = (tmp_path / "scan_agreement.md").read_text()
    assert "training outcomes not measured" in text and "batch 4 instead of the preset's 16" in text
    assert f"of {len(table)} runs at risk" in capsys.readouterr().out


def test_run_all_init_only_skips_the_trained_analyses(tmp_path, capsys):
    assert run_all.main([*ARGS, "--out", str(tmp_path), "--init-only", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "convergence: skipped (--init-only" in printed and "grad_norms: skipped" not in printed
