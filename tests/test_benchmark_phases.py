"""``python -m benchmarks.phases`` runs from a clean clone and prints one table line per mode,
with a cell for each phase and the recorded copy's rows (a copy that recorded nothing raises)."""

from __future__ import annotations

import pytest

from benchmarks import phases


def test_the_phase_table_has_a_cell_per_phase_and_the_recorded_rows(capsys):
    assert phases.main(["--layers", "2", "--pairs", "2", "--warmup", "2", "--no-compile", "--no-progress"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| eager |")]
    assert len(lines) == 1
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert len(cells) == 3 + len(phases.PHASES) + 1
    assert float(cells[1]) > 0  # the plain step's milliseconds
    assert int(cells[-1]) > 0  # the recorded copy's rows


def test_a_recorded_copy_without_rows_is_refused(monkeypatch):
    monkeypatch.setattr(phases.gradscope.Recorder, "frame", lambda self: [])
    with pytest.raises(RuntimeError, match="no rows"):
        phases.main(["--layers", "2", "--pairs", "1", "--warmup", "2", "--no-compile", "--no-progress"])


@pytest.mark.parametrize("bad", [["--warmup", "1"], ["--pairs", "0"]])
def test_bad_counts_are_refused(bad):
    with pytest.raises(SystemExit):
        phases.parse(bad)


def test_unrecorded_steps_leave_no_rows_and_time_the_recorders_pass_through(capsys):
    """``--unrecorded``: the timed steps of the attached Recorder record nothing (the table's
    rows cell is 0), and a timed step that recorded would be refused."""
    args = ["--layers", "2", "--pairs", "2", "--warmup", "2", "--no-compile", "--no-progress", "--unrecorded"]
    assert phases.main(args) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| eager |")]
    assert len(lines) == 1 and lines[0].rstrip(" |").endswith("| 0")


def test_unrecorded_timing_that_recorded_is_refused(monkeypatch):
    monkeypatch.setattr(phases, "UNRECORDED_EVERY", 1)  # every step records
    with pytest.raises(RuntimeError, match="--unrecorded: the timed steps recorded"):
        phases.main(["--layers", "2", "--pairs", "2", "--warmup", "2", "--no-compile", "--no-progress", "--unrecorded"])
