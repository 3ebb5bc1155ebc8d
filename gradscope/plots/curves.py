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
from matplotlib.lines import Line2D

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
    order: Sequence[str] | None = None,
    logy: bool = False,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Best validation loss against depth, one line per (variant, init) (Takase 2022 Fig. 8).

    The line goes through the mean over the runs that converged (filled markers; NaN, a
    gap, where none did). A failed run is drawn too, never dropped: a hollow marker in the
    line's colour at its best validation loss, or, when that is not finite, an x on the
    top edge (legend entry "failed"), shifted sideways when several configurations failed
    so at one depth. Undecided runs (``converged`` NA) are neither drawn nor marked.

    Args:
        summary: sweep summary with ``gradscope.table.SWEEP_COLUMNS`` (one row per run, see
            :func:`gradscope.claims.sweep_summary`); not modified.
        order: the configurations as ``"variant+init"``, in the order of the colours C0, C1,
            ... (the run-name prefix of a figure's other panels, so one colour means one
            configuration everywhere); default sorted.
        logy: log-scaled y axis.
        ax: Axes to draw on.
        title: first title line (preset).

    Returns:
        The Axes; ``ax.lines[k]`` is the k-th configuration, labelled ``"variant+init"``;
        top-edge markers come after.

    Raises:
        ValueError: a sweep column is missing, or ``order`` leaves out a configuration.
    """
    missing = [c for c in SWEEP_COLUMNS if c not in summary.columns]
    if missing:
        raise ValueError(f"sweep summary lacks columns {missing}")
    groups = {f"{variant}+{init}": group for (variant, init), group in summary.groupby(["variant", "init"], sort=True)}
    if order is None:
        order = list(groups)
    left = sorted(set(groups) - set(order))
    if left:
        raise ValueError(f"depth_sweep: order leaves out {left}; it has {list(order)}")
    ax = _style.get_ax(ax)
    marks, hollow = [], False
    for k, label in enumerate(c for c in order if c in groups):
        group = groups[label]
        ok = group["converged"].eq(True).fillna(False).astype(bool)
        failed_rows = group["converged"].eq(False).fillna(False).astype(bool)
        y = group.assign(best=group["best_val_loss"].where(ok)).groupby("depth", sort=True)["best"].mean()
        (line,) = ax.plot(y.index.to_numpy(dtype=float), y.to_numpy(dtype=float), marker="o",
                          color=f"C{order.index(label) % 10}", label=label)
        failed = group.loc[failed_rows]
        finite = failed["best_val_loss"].map(lambda v: v == v and abs(v) != float("inf")).astype(bool)
        if finite.any():
            hollow = True
            ax.scatter(failed.loc[finite, "depth"].to_numpy(dtype=float),
                       failed.loc[finite, "best_val_loss"].to_numpy(dtype=float), s=90, facecolors="none",
                       edgecolors=line.get_color(), linewidths=2, zorder=3)
        depths = sorted({int(d) for d in failed.loc[~finite, "depth"]})
        if depths:
            marks.append((depths, line.get_color()))
    width = max((b - a for a, b in zip(sorted(summary["depth"].unique()), sorted(summary["depth"].unique())[1:])),
                default=1)
    taken: dict[int, int] = {}
    for depths, color in marks:  # (several configurations failing at one depth: side by side, not on top)
        shifted = []
        for d in depths:
            shifted.append(d + 0.06 * width * taken.get(d, 0))
            taken[d] = taken.get(d, 0) + 1
        _style.mark_top_edge(ax, shifted, color)
    ax.set_xlabel("layers per stack")
    _style.integer_x(ax)
    ax.set_ylabel(f"best validation loss ({_style.loss_unit(summary)})")
    if logy:
        ax.set_yscale("log")
    extra = [Line2D([], [], linestyle="none", marker="o", markerfacecolor="none", markeredgecolor="black",
                    markersize=9, markeredgewidth=2, label="failed run, at its best validation loss")] if hollow else []
    _style.legend(ax, extra=extra + ([_style.failed_legend_handle()] if marks else []))
    return _style.finish(ax, title, ["filled: mean of the converged runs; hollow: a failed run; x: non-finite"])


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
