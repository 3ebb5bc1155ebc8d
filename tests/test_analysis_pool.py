"""``python -m analyses`` runs every analysis's runs in one pool and trains a run that several
analyses plan once (``analyses.pool``): each analysis must still get exactly the tables, figure
verdicts and CLAIMS.md section that it gets when run alone."""

from __future__ import annotations

import pandas as pd

import gradscope
from analyses import convergence, cosine, residual_shrink
from analyses.cli import parse_args
from analyses.pool import plan_jobs, run_all
from analyses.runs import Bench
from gradscope.table import COLUMNS

COMMON = ["--preset", "ci", "--max-steps", "3", "--no-progress", "--device", "cpu"]
KINDS = (convergence.Convergence, residual_shrink.ResidualShrink, cosine.Cosine)


def _analyses():
    return [kind("ci", device="cpu", max_steps=3) for kind in KINDS]


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    keys = [c for c in COLUMNS if c != "value"]
    return df.sort_values(keys, kind="stable", na_position="first").reset_index(drop=True)


def test_shared_runs_give_each_analysis_its_own_tables(tmp_path):
    analyses = _analyses()
    import torch
    benches = [Bench(task=a.task(0), device=torch.device("cpu"), batch_size=a.preset.batch_size, seed=0, progress=False)
               for a in analyses]
    jobs = plan_jobs(analyses, benches)
    planned = sum(len(a.plan()) for a in analyses)
    shared = [job for job in jobs if len(job.shares) > 1]
    # residual_shrink's runs are convergence's deep Post-LN runs; cosine's are its shallow ones
    assert len(jobs) < planned and shared, (len(jobs), planned)
    assert {type(analyses[s.analysis]).name for job in shared for s in job.shares} == {k.name for k in KINDS}

    alone, pooled = tmp_path / "alone", tmp_path / "pooled"
    for module in (convergence, residual_shrink, cosine):
        assert module.main([*COMMON, "--out", str(alone)]) == 0
    run_all(_analyses(), parse_args("test", "", [*COMMON, "--out", str(pooled), "--workers", "2"]))
    for kind in KINDS:
        one, two = gradscope.load(alone / f"{kind.name}.parquet"), gradscope.load(pooled / f"{kind.name}.parquet")
        assert len(one) and one["run"].nunique() > 1
        pd.testing.assert_frame_equal(_sorted(one), _sorted(two))  # exact: shared trainings are bit-identical
    assert (alone / "CLAIMS.md").read_text() == (pooled / "CLAIMS.md").read_text()
    sweep = "convergence_sweep.parquet"
    pd.testing.assert_frame_equal(pd.read_parquet(alone / sweep), pd.read_parquet(pooled / sweep))
