"""``analyses.scan_agreement``: the step-0 scan verdict against each convergence run's outcome."""

from __future__ import annotations

import pandas as pd

from analyses import convergence, scan_agreement
from gradscope.scan import DECAY_EXPLODING, DECAY_VANISHING


def test_scan_agreement_at_ci(tmp_path, capsys):
    args = ["--preset", "ci", "--out", str(tmp_path), "--no-progress", "--device", "cpu"]
    assert convergence.main([*args, "--max-steps", "20"]) == 0
    assert scan_agreement.main(args) == 0
    table = pd.read_parquet(tmp_path / "scan_agreement.parquet")
    sweep = pd.read_parquet(tmp_path / "convergence_sweep.parquet")
    assert sorted(table.run) == sorted(sweep.run)
    ratios = table[["encoder_bottom_top", "decoder_bottom_top"]]
    outside = ((ratios < DECAY_VANISHING) | (ratios > DECAY_EXPLODING)).any(axis=1)
    assert list(table.scan == "at risk") == list(outside)  # no non-finite sites at init
    merged = table.merge(sweep[["run", "converged", "outcome"]].rename(columns={"outcome": "status"}), on="run")
    decided = merged.status.isin(["learned", "stuck at chance", "diverged"])
    assert list(merged.agree.notna()) == list(decided)  # a partial run is neither
    expected = (merged.scan == "healthy") == merged.converged.astype("boolean")
    assert list(merged.agree[decided]) == list(expected[decided])
    text = (tmp_path / "scan_agreement.md").read_text()
    n, n_agree = int(decided.sum()), int(merged.agree[decided].sum())
    said = f"**{n_agree} of {n} decided runs agree, {n - n_agree} disagree; {len(merged) - n} partial.**"
    assert said in text
    assert said.strip("*") in capsys.readouterr().out


def test_scan_agreement_needs_the_sweep(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="convergence_sweep.parquet not found"):
        scan_agreement.main(["--preset", "ci", "--out", str(tmp_path), "--device", "cpu"])
