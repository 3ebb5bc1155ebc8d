"""A run over time: a layer × step heatmap, a few layers' series with spikes, non-finite origins.

Each function takes a tidy table (one run and rank; the rows of ``micro_step == -1`` are
used), draws on one Axes and returns it. Long runs are binned along the step axis to at
most ``max_bins`` columns or points (the bin's mean, or for spikes its largest z-score),
and the title says so.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm

from gradscope.plots import _style
from gradscope.recorder.quantities.spike import RULE, first_judged_step, too_few_for_spikes

NONFINITE_MARKER = dict(marker="*", s=90, color="magenta", edgecolor="black", linewidths=0.5, zorder=5)
SPIKE_MARKER = dict(marker="v", s=40, color="red", zorder=4)


def _one_run(df: pd.DataFrame, quantity: str, role: str | None) -> pd.DataFrame:
    rows = df[(df.quantity == quantity) & (df.micro_step == -1)]
    if role is not None:
        rows = rows[rows.role == role]
    if rows.empty:
        raise ValueError(f"no {quantity} rows" + (f" with role {role!r}" if role else ""))
    if rows.run.nunique() > 1 or rows["rank"].nunique() > 1:
        raise ValueError(f"one run and rank at a time; got runs {sorted(rows.run.unique())}, ranks {sorted(rows['rank'].unique())}")
    return rows


def step_bins(steps: np.ndarray, max_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Bin index of each step and each bin's left edge: ``max_bins`` equal-width bins over
    the recorded range, or one bin per distinct step when there are fewer steps."""
    distinct = np.unique(steps)
    if len(distinct) <= max_bins:
        return np.searchsorted(distinct, steps), distinct.astype(float)
    edges = np.linspace(distinct[0], distinct[-1] + 1, max_bins + 1)
    return np.clip(np.searchsorted(edges, steps, side="right") - 1, 0, max_bins - 1), edges[:-1]


def layer_heatmap(df: pd.DataFrame, *, quantity: str = "act_grad_norm", role: str = "layer_out", max_bins: int = 500,
                  nonfinite: bool = True, ax: Axes | None = None, title: str | None = None) -> Axes:
    """Heatmap of a per-layer quantity: one row per (stack, layer), one column per step bin,
    log colour scale. Non-finite origins are starred at their step and layer.

    Args:
        df: tidy table of one run and rank; not modified.
        quantity: the quantity to draw (default ``act_grad_norm``).
        role: which sites (default ``layer_out``, the layer outputs).
        max_bins: most columns; more steps are averaged in equal-width bins.
        nonfinite: mark the first non-finite site of each step (:func:`mark_nonfinite`).
        ax: Axes to draw on.
        title: first title line (preset, model).

    Returns:
        The Axes; ``ax.collections[0]`` is the mesh (rows = ``ax.get_yticklabels()``).

    Raises:
        ValueError: no such rows, or several runs or ranks.
    """
    rows = _one_run(df, quantity, role)
    bins, left = step_bins(rows.step.to_numpy(), max_bins)
    value = rows.value.where(np.isfinite(rows.value) & (rows.value > 0))  # log scale: non-positive left blank
    grid = value.groupby([rows["stack"].to_numpy(), rows.layer.to_numpy(), bins]).mean().unstack()
    grid = grid.reindex(columns=range(len(left)))
    ax = _style.get_ax(ax)
    positive = grid.to_numpy(dtype=float)
    finite = positive[np.isfinite(positive)]
    norm = LogNorm(vmin=finite.min(), vmax=finite.max()) if finite.size else LogNorm()
    right = left[-1] + (left[-1] - left[-2] if len(left) > 1 else 1)
    mesh = ax.pcolormesh(np.append(left, right), np.arange(len(grid) + 1), np.ma.masked_invalid(positive),
                         norm=norm, cmap="viridis", shading="flat")
    ax.figure.colorbar(mesh, ax=ax, label=_style.quantity_label(quantity, _reduction(df)) + " (log colour)")
    labels = [f"{stack or 'blocks'} {layer}" for stack, layer in grid.index]
    ax.set_yticks(np.arange(len(grid)) + 0.5, labels, fontsize="small" if len(labels) < 30 else "x-small")
    ax.set_xlabel("step")
    ax.set_ylabel(f"layer ({role} sites, 1 = bottom)")
    if nonfinite:
        mark_nonfinite(df, ax, index=list(grid.index))
    n_steps = rows.step.nunique()
    binned = f"mean over bins of {(right - left[0]) / len(left):.3g} steps" if n_steps > len(left) else ""
    return _style.finish(ax, title, [f"{quantity} ({role}), {n_steps} steps {rows.step.min()}–{rows.step.max()}", binned])


def mark_nonfinite(df: pd.DataFrame, ax: Axes, *, index: Sequence[tuple] | None = None, max_marks: int = 200) -> list:
    """Stars the first non-finite site of each step on a heatmap (or a series plot).

    The origin of a step is its ``nonfinite`` row with value 0 (first NaN/Inf in forward
    order), else its ``nonfinite_grad`` row with value 0. On a heatmap (``index`` = its
    rows) a star sits at that step and the row of the site's (stack, layer); a site outside
    the layers (embedding, final norm) is drawn on its stack's bottom or top row. Without
    ``index`` the stars sit on the top edge.

    Returns:
        The origins drawn: dicts with step, site, stack, layer.
    """
    bad = df[df.quantity.isin(["nonfinite", "nonfinite_grad"]) & (df.value == 0)]
    if bad.empty:
        return []
    bad = bad.assign(fwd=bad.quantity != "nonfinite").sort_values(["step", "fwd"]).drop_duplicates("step")
    bad = bad.iloc[:max_marks]
    origins = [dict(step=int(r.step), site=r.site, stack=r.stack, layer=None if pd.isna(r.layer) else int(r.layer))
               for r in bad.itertuples(index=False)]
    if index is None:
        ys = [1.0] * len(origins)
        from matplotlib.transforms import blended_transform_factory

        ax.scatter([o["step"] for o in origins], ys, transform=blended_transform_factory(ax.transData, ax.transAxes),
                   clip_on=False, label="first non-finite site", **NONFINITE_MARKER)
        return origins
    ys = []
    for o in origins:
        mine = [i for i, (stack, _) in enumerate(index) if stack == o["stack"]] or [0]
        layers = {index[i][1]: i for i in mine}
        if o["layer"] in layers:
            ys.append(layers[o["layer"]] + 0.5)
        else:  # embedding (layer 0) → bottom row, final norm (no layer) → top row
            ys.append((mine[0] if o["layer"] == 0 else mine[-1]) + 0.5)
    ax.scatter([o["step"] for o in origins], ys, label="first non-finite site", **NONFINITE_MARKER)
    ax.legend(loc="upper left", fontsize="small")
    return origins


def layer_series(df: pd.DataFrame, *, layers: Sequence[tuple[str, int]] | None = None, quantity: str = "act_grad_norm",
                 role: str = "layer_out", spikes: pd.DataFrame | None = None, max_bins: int = 2000,
                 ax: Axes | None = None, title: str | None = None) -> Axes:
    """A few layers' series over steps (log y), with their spikes marked (▼) and non-finite
    origins starred on the top edge.

    Args:
        df: tidy table of one run and rank; not modified.
        layers: (stack, layer) pairs to draw; default the bottom, middle and top layer of
            each stack.
        quantity: quantity to draw (default ``act_grad_norm``).
        role: which sites (default ``layer_out``).
        spikes: spike rows (``quantity == "spike"``, as recorded or from
            :func:`gradscope.recorder.quantities.spike.find_spikes`); default the table's own.
        max_bins: most points per line; longer series are averaged in equal-width bins
            (spikes keep their exact step).
        ax: Axes to draw on.
        title: first title line.

    Returns:
        The Axes; ``ax.lines[k]`` is the k-th layer, ``ax.collections`` the markers.
    """
    rows = _one_run(df, quantity, role)
    if layers is None:
        layers = []
        for stack, group in rows.groupby("stack", sort=False):
            found = sorted(group.layer.dropna().unique().tolist())
            layers += [(stack, found[i]) for i in sorted({0, len(found) // 2, len(found) - 1})]
    looked = spikes is not None or (df.quantity == "spike").any()
    spikes = df[df.quantity == "spike"] if spikes is None else spikes
    ax = _style.get_ax(ax)
    marked = []
    for stack, layer in layers:
        line = rows[(rows["stack"] == stack) & (rows.layer == layer)].sort_values("step")
        if line.empty:
            raise ValueError(f"no {quantity} rows for {stack} layer {layer}")
        bins, _ = step_bins(line.step.to_numpy(), max_bins)
        points = line.groupby(bins).agg(step=("step", "mean"), value=("value", "mean"))
        (drawn,) = ax.plot(points.step, points.value, label=f"{stack or 'blocks'} {layer}")
        hits = spikes[(spikes.site.isin(line.site.unique())) & (spikes.role == role)]
        if not hits.empty:
            at = line.set_index("step").value.reindex(hits.step.to_numpy())
            ax.scatter(hits.step, at, label="_spike", **{**SPIKE_MARKER, "color": drawn.get_color()})
            marked.append(len(hits))
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(_style.quantity_label(quantity, _reduction(df)))
    if len(df):  # (every step of the run: non-finite values draw nothing and would shrink the axis to the finite part)
        first, last = float(df.step.min()), float(df.step.max())
        ax.set_xlim(first - 0.5, last + 0.5) if first == last else ax.set_xlim(first, last)
    mark_nonfinite(df, ax)
    extra = [] if not marked else [_spike_handle()]
    _style.legend(ax, extra)
    return _style.finish(ax, title, [f"{quantity} at {role} sites", _spike_note(rows, spikes, marked, looked)])


def _spike_note(rows: pd.DataFrame, spikes: pd.DataFrame, marked: list[int], looked: bool) -> str:
    """What the ▼ marks say, and where the rule could not look (never a bare "no spikes"
    over steps it could not judge)."""
    first = first_judged_step(rows)
    blind = f"; steps before {first} not judged" if first else ""
    if marked:
        return f"▼ spike: {RULE} ({sum(marked)} shown{blind})"
    short = too_few_for_spikes(int(rows.step.nunique()))
    if short:
        return short
    if not looked:
        return "spikes not looked for: no 'spike' rows (record it, or pass spikes=find_spikes(df))"
    if first is None:
        return "spikes not judged: no series had enough usable earlier values"
    elsewhere = f"; {len(spikes)} spikes at other sites" if len(spikes) else ""
    return f"no spikes at these layers from step {first} on (earlier steps not judged{elsewhere})"


def _spike_handle():
    from matplotlib.lines import Line2D

    return Line2D([], [], linestyle="none", marker="v", color="red", label="spike")


def _reduction(df: pd.DataFrame) -> str:
    values = df["reduction"].dropna().unique() if "reduction" in df else []
    return str(values[0]) if len(values) == 1 else "mean"
