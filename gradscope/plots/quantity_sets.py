"""Panels of the optional quantity sets over a run: mixture-of-experts routing and activation
outliers (``gradscope report`` draws them when the table has their rows).

Each function takes a tidy table (one run and rank; the step's rows, ``micro_step == -1``),
draws on one Axes and returns it; a table without the quantity raises ``ValueError``, so a
caller draws a panel only for the names :func:`present` returns.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.axes import Axes

from gradscope.plots import _style

MOE_QUANTITIES: tuple[str, ...] = ("moe_imbalance", "moe_load_cv", "router_entropy", "router_z", "router_topk_mass")
"""The ``moe`` set's per-layer routing statistics (one row per MoE layer and step)."""
EXPERT_LOAD = "moe_load"
"""The ``moe`` set's per-expert load (``layer_j`` = expert), drawn as a layer × expert heatmap."""
OUTLIER_QUANTITIES: tuple[str, ...] = ("act_abs_max", "act_kurtosis", "massive_act_count")
"""The ``outliers`` set's per-site statistics of the forward tensor."""
LABELS = {
    "moe_imbalance": "max load / mean load (1 = balanced)",
    "moe_load_cv": "std / mean of expert loads",
    "router_entropy": "mean router entropy (nats)",
    "router_z": "router z-loss (mean logsumexp²)",
    "router_topk_mass": "softmax mass on the chosen experts",
    "act_abs_max": "max |h|",
    "act_kurtosis": "kurtosis of h",
    "massive_act_count": "massive activations (count)",
}


def present(df: pd.DataFrame, quantities: tuple[str, ...]) -> list[str]:
    """The names of ``quantities`` that have step rows (``micro_step == -1``) in ``df``, in order."""
    have = set(df.loc[df.micro_step == -1, "quantity"].unique())
    return [q for q in quantities if q in have]


def _step_rows(df: pd.DataFrame, quantity: str) -> pd.DataFrame:
    rows = df[(df.quantity == quantity) & (df.micro_step == -1)]
    if rows.empty:
        raise ValueError(f"no {quantity} rows with micro_step == -1")
    if rows.run.nunique() > 1 or rows["rank"].nunique() > 1:
        raise ValueError(f"one run and rank at a time; got runs {sorted(rows.run.unique())}, ranks {sorted(rows['rank'].unique())}")
    return rows


def quantity_by_site(df: pd.DataFrame, quantity: str, *, max_lines: int = 6, ax: Axes | None = None,
                     title: str | None = None) -> Axes:
    """One line per site over steps (per-head or per-expert rows, ``layer_j`` set, are reduced
    to their max). With more sites than ``max_lines``, the layer outputs when the quantity
    has any, then ``max_lines`` sites evenly spaced from bottom to top.

    Args:
        df: tidy table of one run and rank; not modified.
        quantity: the quantity to draw.
        max_lines: most lines.
        ax: Axes to draw on.
        title: first title line.

    Returns:
        The Axes; ``ax.lines[k]`` is the k-th site drawn, labelled with its site.

    Raises:
        ValueError: no such rows, or several runs or ranks.
    """
    rows = _step_rows(df, quantity)
    if rows.site.nunique() > max_lines and (rows.role == "layer_out").any():
        rows = rows[rows.role == "layer_out"]
    order = rows.drop_duplicates("site").sort_values(["stack", "layer", "site"], na_position="last").site.tolist()
    picked = [order[i] for i in sorted({round(x) for x in np.linspace(0, len(order) - 1, min(max_lines, len(order)))})]
    ax = _style.get_ax(ax)
    for site in picked:
        line = rows[rows.site == site].groupby("step").value.max()
        ax.plot(line.index, line.to_numpy(), label=site or "model")
    values = rows.value[np.isfinite(rows.value)]
    if len(values) and values.min() > 0 and values.max() > 100 * values.min():
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(LABELS.get(quantity, quantity))
    ax.legend(fontsize="x-small")
    shown = f"{len(picked)} of {rows.site.nunique()} sites" if len(picked) < rows.site.nunique() else f"{len(picked)} sites"
    return _style.finish(ax, title, [f"{quantity}: {shown}", "per-head/expert rows: their max" if rows.layer_j.notna().any() else ""])


def expert_load_by_layer(df: pd.DataFrame, *, step: int | None = None, ax: Axes | None = None, title: str | None = None) -> Axes:
    """Heatmap of ``moe_load`` at one step: one row per MoE layer, one column per expert.

    Args:
        df: tidy table of one run and rank; not modified.
        step: the step (default the last with ``moe_load`` rows).
        ax: Axes to draw on.
        title: first title line.

    Returns:
        The Axes; ``ax.collections[0]`` is the mesh (rows = ``ax.get_yticklabels()``).

    Raises:
        ValueError: no ``moe_load`` rows (at ``step``), or several runs or ranks.
    """
    rows = _step_rows(df, EXPERT_LOAD)
    step = int(rows.step.max()) if step is None else step
    rows = rows[rows.step == step]
    if rows.empty:
        raise ValueError(f"no {EXPERT_LOAD} rows at step {step}")
    grid = rows.pivot_table(index="site", columns="layer_j", values="value", aggfunc="first", sort=False)
    layers = rows.drop_duplicates("site").sort_values(["stack", "layer", "site"], na_position="last").site
    grid = grid.reindex(index=layers.tolist())
    ax = _style.get_ax(ax)
    mesh = ax.pcolormesh(np.arange(grid.shape[1] + 1), np.arange(len(grid) + 1), np.ma.masked_invalid(grid.to_numpy(float)),
                         cmap="viridis", shading="flat")
    ax.figure.colorbar(mesh, ax=ax, label="share of the layer's assignments")
    ax.set_yticks(np.arange(len(grid)) + 0.5, grid.index.tolist(), fontsize="x-small")
    ax.set_xticks(np.arange(grid.shape[1]) + 0.5, [str(int(e)) for e in grid.columns], fontsize="x-small")
    ax.set_xlabel("expert")
    experts = grid.shape[1]
    return _style.finish(ax, title, [f"{EXPERT_LOAD} at step {step} (balanced: {1 / experts:.3g} each)"])


def summary_lines(df: pd.DataFrame, quantities: tuple[str, ...]) -> list[str]:
    """One markdown line per present quantity: its largest value at the last step, and where."""
    lines = []
    for quantity in present(df, quantities):
        rows = _step_rows(df, quantity)
        last = rows[rows.step == rows.step.max()]
        top = last.loc[last.value.idxmax()] if last.value.notna().any() else last.iloc[0]
        lines.append(f"- `{quantity}` at step {int(top.step)}: largest {top.value:.4g} at `{top.site or 'model'}` "
                     f"({last.site.nunique()} sites)")
    return lines
