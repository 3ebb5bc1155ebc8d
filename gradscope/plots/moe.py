"""Mixture-of-experts plots over the tidy table (the ``moe`` quantities, docs/moe.md)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes

from gradscope.plots._style import get_ax


def _moe_layers(df: pd.DataFrame) -> list[str]:
    """The MoE layers' sites in ``df`` (rows of ``moe_load``), in layer order."""
    rows = df[df["quantity"] == "moe_load"]
    return list(rows.sort_values(["layer", "site"])["site"].drop_duplicates())


def expert_load(df: pd.DataFrame, *, site: str | None = None, run: str | None = None, vmax: float | None = None,
                ax: Axes | None = None, title: str = "") -> Axes:
    """Heatmap of ``moe_load`` of one MoE layer: experts (rows) over recorded steps (columns).

    Args:
        df: a table with ``moe_load`` rows (``layer_j`` is the expert).
        site: the MoE layer (default: the first one of the table).
        run: the run to draw (default: the table's only run).
        vmax: the colour scale's top (default: the largest share drawn, at least 2/E); give
            one value to compare runs side by side.
        ax: where to draw (default: the current Axes).
        title: first line of the title (the preset, the run).

    Returns:
        The Axes, with one image whose array is (experts, steps).

    Raises:
        ValueError: no ``moe_load`` rows, several runs and no ``run``, or an unknown ``site``.
    """
    ax = get_ax(ax)
    rows = df[df["quantity"] == "moe_load"]
    runs = sorted(rows["run"].unique())
    if run is None and len(runs) > 1:
        raise ValueError(f"expert_load: the table holds runs {runs}: pass run=")
    rows = rows if run is None else rows[rows["run"] == run]
    layers = _moe_layers(rows)
    if not layers:
        raise ValueError("expert_load: no moe_load rows (record with quantities='moe')")
    site = layers[0] if site is None else site
    if site not in layers:
        raise ValueError(f"expert_load: site {site!r} has no moe_load rows; valid: {layers}")
    grid = rows[(rows["site"] == site) & (rows["micro_step"] == -1)].pivot_table(
        index="layer_j", columns="step", values="value")
    E = len(grid.index)
    image = ax.imshow(grid.to_numpy(), aspect="auto", origin="lower", cmap="viridis", vmin=0.0,
                      vmax=vmax if vmax is not None else max(float(np.nanmax(grid.to_numpy())), 2.0 / E), interpolation="nearest",
                      extent=(-0.5, len(grid.columns) - 0.5, -0.5, E - 0.5))
    steps = list(grid.columns)
    ticks = np.linspace(0, len(steps) - 1, min(len(steps), 6)).round().astype(int)
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    ax.set_yticks(range(E))
    ax.set_xlabel("step")
    ax.set_ylabel("expert")
    ax.figure.colorbar(image, ax=ax, label="share of assignments (1/E balanced)")
    ax.set_title("\n".join(t for t in (title, f"{site}: expert load (moe_load) per recorded step") if t))
    return ax


def routing_series(df: pd.DataFrame, *, quantity: str = "moe_imbalance", runs: Sequence[str] | None = None,
                   ax: Axes | None = None, title: str = "") -> Axes:
    """One line per run and MoE layer of a per-layer routing quantity over steps
    (``moe_imbalance``, ``moe_load_cv``, ``router_entropy``, ``router_z``, ...).

    Returns:
        The Axes; its lines are labelled ``<run> <site>``.

    Raises:
        ValueError: ``df`` has no rows of ``quantity``.
    """
    ax = get_ax(ax)
    rows = df[(df["quantity"] == quantity) & (df["micro_step"] == -1) & df["layer_j"].isna()]
    if rows.empty:
        raise ValueError(f"routing_series: no {quantity!r} rows (record with quantities='moe')")
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs if runs is not None else sorted(rows["run"].unique())):
        one = rows[rows["run"] == run]
        for site, series in one.sort_values("step").groupby("site", sort=False):
            ax.plot(series["step"], series["value"], styles[i % len(styles)], marker=".", label=f"{run} {site}")
    ax.set_xlabel("step")
    ax.set_ylabel(quantity)
    ax.legend(fontsize="x-small")
    ax.set_title("\n".join(t for t in (title, f"{quantity} per MoE layer") if t))
    return ax
