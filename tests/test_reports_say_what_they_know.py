"""Figures and reports say no more than they know (issue 23): a spike check that did not
run or had too few steps says so instead of "no spikes"; step and layer axes have whole
ticks; a table is not written as parquet under another suffix."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import gradscope  # noqa: E402
from gradscope.plots.over_time import layer_series  # noqa: E402
from gradscope.report import spike_table  # noqa: E402


def _table(steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
    rec = gradscope.Recorder(model, quantities=["act_grad_norm"])
    for step in range(steps):
        with rec.step(step):
            model(torch.randn(2, 4)).square().sum().backward()
    rec.close()
    return rec.frame()


def _title(df, **kw) -> str:
    fig, ax = plt.subplots()
    try:
        layer_series(df, ax=ax, **kw)
        ticks = ax.get_xticks()
        assert all(float(t).is_integer() for t in ticks), f"fractional step ticks {ticks}"
        return ax.get_title()
    finally:
        plt.close(fig)


def test_a_short_series_says_too_few_steps_not_no_spikes():
    df = _table(4)
    title = _title(df, spikes=df.iloc[0:0])
    assert "too few steps to look for spikes (4" in title and "no spikes" not in title
    assert "too few steps" in spike_table(df.iloc[0:0], steps=4)[0]


def test_a_series_without_spike_rows_says_spikes_were_not_looked_for():
    df = _table(70)
    title = _title(df)
    assert "spikes not looked for" in title
    assert "no spikes" in _title(df, spikes=df.iloc[0:0])  # looked for (the caller passed them): none
    assert spike_table(df.iloc[0:0], steps=70, looked_from=64) == [
        "No spikes (steps before 64 not judged: the rule needs 64 earlier values)."]
    assert "None found, but no series had enough" in spike_table(df.iloc[0:0], steps=70)[0]


@pytest.mark.parametrize("name", ["run.csv", "run", "run.txt"])
def test_save_refuses_a_suffix_that_is_not_parquet(tmp_path, name):
    df = _table(1)
    with pytest.raises(ValueError, match=r"\*\.parquet.*to_csv"):
        gradscope.save_frame(df, tmp_path / name)
    assert list(tmp_path.iterdir()) == []
    gradscope.save_frame(df, tmp_path / "run.parquet")
    assert len(gradscope.load(tmp_path / "run.parquet")) == len(df)


def test_report_of_an_unreadable_part_says_which_file_in_one_line(tmp_path):
    from gradscope.report import main

    bad = tmp_path / "run" / "part-r0-0000000000-0000000001-abcd.parquet"
    bad.parent.mkdir()
    bad.write_bytes(b"PAR1 not a parquet file")
    with pytest.raises(SystemExit, match=r"^gradscope report: .*part-r0-0000000000-0000000001-abcd.parquet"):
        main([str(bad.parent), "--out", str(tmp_path / "out"), "--no-progress"])
    assert not (tmp_path / "out").exists()


def test_a_run_that_went_non_finite_is_said_so_and_drawn_to_its_last_step(tmp_path):
    """The last step's layer gradients are NaN: the report says non-finite, not exploding
    (a NaN top made the ratio inf), and the series axis reaches the last step (NaN points
    draw nothing, which shrank it to the finite part)."""
    from gradscope.report import decay_lines

    df = _table(12)
    late = (df.step >= 8) & (df.quantity == "act_grad_norm")
    df.loc[late, "value"] = float("nan")
    lines = decay_lines(df.assign(role=df.role), 11)
    assert lines and all("non-finite" in line and "exploding" not in line for line in lines), lines
    fig, ax = plt.subplots()
    try:
        layer_series(df, ax=ax, spikes=df.iloc[0:0])
        assert ax.get_xlim()[1] >= 11
    finally:
        plt.close(fig)


def test_a_report_of_two_runs_under_one_name_says_their_rows_are_mixed(tmp_path):
    from gradscope.report import report

    for folder in ("lr0.1", "lr1.0"):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
        rec = gradscope.Recorder(model, quantities=["act_grad_norm"], log_dir=tmp_path / folder / "seed0")
        for step in range(3):
            with rec.step(step):
                model(torch.randn(2, 4)).square().sum().backward()
        rec.close()
    with pytest.warns(UserWarning, match="share a run name"):
        summary = report(tmp_path, tmp_path / "out", progress=False)
    assert "rows of several runs share this name" in summary.read_text()
