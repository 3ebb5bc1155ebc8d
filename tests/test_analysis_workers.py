"""``--workers``: an analysis's runs in worker processes give the tables a serial run gives
(issue 49: the 2 cores as two single-thread workers), and a failing run stops the pool."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import gradscope
from analyses import cosine
from analyses.runner import Analysis
from analyses.runs import Bench, RunSpec
from analyses.workers import collect_runs
from gradscope import presets


def test_two_workers_give_the_serial_tables(tmp_path):
    serial, parallel = tmp_path / "serial", tmp_path / "parallel"
    common = ["--preset", "ci", "--max-steps", "3", "--no-progress", "--device", "cpu"]
    assert cosine.main([*common, "--out", str(serial)]) == 0
    assert cosine.main([*common, "--out", str(parallel), "--workers", "2"]) == 0
    one, two = gradscope.load(serial / "cosine.parquet"), gradscope.load(parallel / "cosine.parquet")
    assert one["run"].nunique() > 1, "several runs, so the pool had work to share"
    pd.testing.assert_frame_equal(one, two)  # exact: same seeds, same thread count, the plan's order
    assert (serial / "CLAIMS.md").read_text() == (parallel / "CLAIMS.md").read_text()


class Failing(Analysis):
    name = "failing"

    def plan(self):
        size = presets.get("ci").size
        return [RunSpec(f"r{k}", size) for k in range(3)]

    def collect(self, spec, bench):
        raise RuntimeError(f"run {spec.run} failed")


def test_a_failing_run_raises_its_error():
    preset = presets.get("ci")
    bench = Bench(task=preset.task(0), device=torch.device("cpu"), batch_size=2, seed=0, progress=False)
    with pytest.raises(RuntimeError, match=r"run r\d failed"):
        collect_runs(Failing("ci"), Failing("ci").plan(), bench, workers=2, threads=1, progress=False)


def test_an_analysis_that_keeps_state_runs_here():
    from analyses.spike_replay import SpikeReplay
    assert not SpikeReplay.runs_apart and Analysis.runs_apart
