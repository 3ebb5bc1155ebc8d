"""Training curves and depth sweeps (Takase 2022 Fig. 1/6/8/9, Xu 2020 Tables 1/3,
Wang 2019 Fig. 3, Nguyen & Salazar 2019).

Divergence is drawn, never dropped: a non-finite loss, or a ``nonfinite`` /
``nonfinite_grad`` row of the recorder, puts an x on the top edge of the Axes at that
step in the line's colour, with one legend entry for all such markers.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
from matplotlib.axes import Axes

from gradscope.plots import _style
from gradscope.table import SWEEP_COLUMNS
from gradscope.table import select as S


def loss_curves(
    df: pd.DataFrame,
    *,
    quantity: str = "loss",
    hue: str = "variant",
    hue_order: Sequence[str] | None = None,
    logy: bool = False,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Loss against optimizer step, one line per hue level (Takase 2022 Fig. 1/6/9).

    Non-finite points break the line; each diverged run also gets an x on the top edge
    at its first non-finite step (see :func:`select.divergence_step`). Those markers are drawn
    after all curves, so ``ax.lines[k]`` is the k-th hue level.

    Args:
        df: tidy table; not modified.
        quantity: ``"loss"`` (training) or ``"val_loss"``.
        hue: column for one line per value (each value must be one run).
        hue_order: order of the lines; default sorted.
        logy: log-scaled y axis.
        ax: Axes to draw on.
        title: first title line (preset, model size, schedule).

    Returns:
        The Axes.

    Raises:
        ValueError: no rows of ``quantity``, or a hue value covers several runs.
    """
    data = S.rows(df, quantity=quantity)
    if data.empty:
        raise ValueError(f"no {quantity} rows")
    points = S.one_per_point(data)
    S.check_one_run_per_hue(points, hue)
    ax = _style.get_ax(ax)
    marks = []
    for level in S.hue_values(points, hue, hue_order):
        pts = points.loc[points[hue] == level].sort_values("step")
        (line,) = ax.plot(pts["step"].to_numpy(dtype=float), pts["value"].to_numpy(dtype=float),
                          label=level)
        run_rows = S.rows(df, run=str(pts["run"].iloc[0]))
        diverged = S.divergence_step(run_rows, pts)
        if diverged is not None:
            marks.append((diverged, line.get_color()))
    for step, color in marks:
        _style.mark_top_edge(ax, [step], color)
    ax.set_xlabel("optimizer step")
    _style.integer_x(ax)
    ax.set_ylabel(_style.quantity_label(quantity, S.reduction_text(points), _style.loss_unit(df)))
    if logy:
        ax.set_yscale("log")
    _style.legend(ax, extra=[_style.failed_legend_handle()] if marks else [], title=hue)
    return _style.finish(ax, title, [f"{len(marks)} run(s) diverged" if marks else ""])


def depth_sweep(
    summary: pd.DataFrame,
    *,
    logy: bool = False,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Best validation loss against depth, one line per (variant, init) (Takase 2022 Fig. 8).

    A depth where any run of a (variant, init) failed gets an x on the top edge in that
    line's colour (legend entry "failed"); the line's y there is the mean over the runs
    that converged, NaN (a gap) when none did. Undecided runs (``converged`` NA) are
    neither drawn nor marked.

    Args:
        summary: sweep summary with ``gradscope.table.SWEEP_COLUMNS`` (one row per run, see
            :func:`gradscope.claims.sweep_summary`); not modified.
        logy: log-scaled y axis.
        ax: Axes to draw on.
        title: first title line (preset).

    Returns:
        The Axes; ``ax.lines[k]`` is the k-th (variant, init) in sorted order, labelled
        ``"variant + init"``; failed markers come after.

    Raises:
        ValueError: a sweep column is missing.
    """
    missing = [c for c in SWEEP_COLUMNS if c not in summary.columns]
    if missing:
        raise ValueError(f"sweep summary lacks columns {missing}")
    ax = _style.get_ax(ax)
    marks = []
    for (variant, init), group in summary.groupby(["variant", "init"], sort=True):
        ok = group["converged"].eq(True).fillna(False).astype(bool)
        failed_rows = group["converged"].eq(False).fillna(False).astype(bool)
        per_depth = group.assign(best=group["best_val_loss"].where(ok)).groupby("depth", sort=True)
        y = per_depth["best"].mean()
        (line,) = ax.plot(y.index.to_numpy(dtype=float), y.to_numpy(dtype=float), marker="o",
                          label=f"{variant} + {init}")
        failed = sorted({int(d) for d in group.loc[failed_rows, "depth"]})
        if failed:
            marks.append((failed, line.get_color()))
    for depths, color in marks:
        _style.mark_top_edge(ax, depths, color)
    ax.set_xlabel("layers per stack")
    _style.integer_x(ax)
    ax.set_ylabel(f"best validation loss ({_style.loss_unit(summary)})")
    if logy:
        ax.set_yscale("log")
    _style.legend(ax, extra=[_style.failed_legend_handle()] if marks else [])
    return _style.finish(ax, title, ["converged runs only; x = failed"])


def w_over_sigma_curves(
    df: pd.DataFrame,
    *,
    hue_order: Sequence[str] | None = None,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Mean LayerNorm w/σ over every norm of a run against step, one line per run (Xu 2020 Table 2).

    Args:
        df: tidy table with ``ln_w_over_sigma`` rows; not modified.
        hue_order: the runs to draw, in order (default: every run, sorted).
        ax: Axes to draw on.
        title: first title line.

    Returns:
        The Axes; the reference line is the last line, labelled ``"w/σ = 1"``.
    """
    ax = _style.get_ax(ax)
    pts = S.one_per_point(S.rows(df, quantity="ln_w_over_sigma"))
    for run in S.hue_values(pts, "run", hue_order):
        series = pts.loc[pts["run"] == run].groupby("step")["value"].mean()
        ax.plot(series.index.to_numpy(float), series.to_numpy(float), marker="o", label=run)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="w/σ = 1")
    ax.set_xlabel("optimizer step (0 = init)")
    ax.set_ylabel("mean w/σ over all norms (dimensionless)")
    ax.legend(fontsize="small")
    return _style.finish(ax, title, ["mean over every norm of the run"])
