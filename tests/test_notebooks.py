"""The committed notebooks run top to bottom at the ci preset; a broken cell fails."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_the_notebooks_are_committed():
    assert [p.stem for p in NOTEBOOKS] == ["01_quickstart", "02_post_pre_b2t", "03_huggingface", "04_dlcl_training", "05_long_run",
                                              "06_spike_replay", "07_moe_routing"]
    for path in NOTEBOOKS:  # committed with outputs, so they read well on a repository page
        nb = nbformat.read(path, as_version=4)
        assert any(cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    monkeypatch.setenv("GRADSCOPE_PRESET", "ci")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.outputs = [] if cell.cell_type == "code" else cell.get("outputs", [])
    nbclient.NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()


def test_a_broken_cell_fails(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("raise RuntimeError('broken cell')")]
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="broken cell"):
        nbclient.NotebookClient(nb, timeout=60, kernel_name="python3").execute()
