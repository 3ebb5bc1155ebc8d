"""Matrix heatmaps: Takase (2022) Fig. 5 cosine similarities, Wang (2019) Fig. 5 DLCL weights.

Matrices are stored as rows (``layer`` = i, ``layer_j`` = j) and pivoted here with
:func:`gradscope.table.select.matrix`. Heatmaps put row 0 at the top (seaborn), so the
"lower-left" block is deep rows against shallow columns. Masked cells are masked in the
drawn array (``ax.collections[0].get_array().mask``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.axes import Axes

from gradscope.plots import _style
from gradscope.table import select as S
from gradscope.table.select import StepSpec


def _one_matrix(
    df: pd.DataFrame, quantity: str, run: str | None, variant: str | None, stack: str,
    step: StepSpec, site: str | None = None,
) -> tuple[np.ndarray, str, int]:
    """:func:`select.one_matrix`, raising ValueError when there is nothing to draw."""
    mat, name, resolved = S.one_matrix(df, quantity, run=run, variant=variant, stack=stack,
                                       step=step, site=site)
    if resolved is None:
        raise ValueError(f"no {quantity} rows for run={run!r} variant={variant!r} "
                         f"stack={stack!r} step={step!r} site={site!r}")
    return mat, name, resolved


def _labels(size: int) -> list[str]:
    return [f"$y_{{{k}}}$" for k in range(size)]


def cosine_heatmap(
    df: pd.DataFrame,
    *,
    run: str | None = None,
    variant: str | None = None,
    stack: str | None = None,
    step: StepSpec = "last",
    vmin: float = 0.0,
    vmax: float = 1.0,
    cmap: str = "viridis",
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Lower-triangle heatmap of S[i, j] = cos(y_i, y_j) (Takase 2022 Fig. 5).

    Args:
        df: tidy table with ``cosine`` rows; not modified.
        run: run name; overrides ``variant``.
        variant: variant whose single run is drawn.
        stack: ``"encoder"`` or ``"decoder"``, or a foreign model's block list (default: the
            table's only stack; in a zoo encoder–decoder table, the paper's stack).
        step: step or ``"first"`` / ``"last"`` (default: the trained model).
        vmin: colour-scale minimum, fixed so panels compare (default 0; lower values
            are clipped and the colorbar says so with an arrow).
        vmax: colour-scale maximum (default 1).
        cmap: matplotlib colormap name.
        ax: Axes to draw on.
        title: first title line (preset, variant).

    Returns:
        The Axes; ``ax.collections[0]`` is the mesh, upper triangle and missing cells masked.
    """
    stack = S.stack_of(df, stack, quantity="cosine", zoo_default="decoder", caller="cosine_heatmap")
    mat, name, resolved = _one_matrix(df, "cosine", run, variant, stack, step)
    mask = np.triu(np.ones_like(mat, dtype=bool), k=1) | np.isnan(mat)
    ax = _style.get_ax(ax)
    below = bool(np.nanmin(mat) < vmin) if np.isfinite(mat).any() else False
    sns.heatmap(mat, mask=mask, vmin=vmin, vmax=vmax, cmap=cmap, ax=ax, square=True,
                xticklabels=_labels(len(mat)), yticklabels=_labels(len(mat)),
                cbar_kws={"label": "cosine similarity (mean over tokens)",
                          "extend": "min" if below else "neither"})
    ax.set_xlabel("layer output j ($y_0$ = embedding)")
    ax.set_ylabel("layer output i")
    return _style.finish(ax, title, [f"{name} · {stack}", f"step {resolved}",
                                     "upper triangle masked"])


def dlcl_heatmap(
    df: pd.DataFrame,
    *,
    run: str | None = None,
    variant: str | None = None,
    stack: str | None = None,
    step: StepSpec = "last",
    site: str | None = None,
    abs_threshold: float = 0.1,
    rel_threshold: float = 0.05,
    vlim: float = 1.0,
    cmap: str = "RdBu_r",
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Heatmap of the learned DLCL weights W[r, k] (Wang 2019 Fig. 5a/b).

    Cells are masked when ``|w| < abs_threshold`` or ``|w| < rel_threshold × max_k |W[r, k]|``
    (the paper's 0.1 and 5% of the row maximum), and where no value was recorded (above
    the diagonal); the rule is printed in the title. A transparent-attention W
    ((N+1)×M) is drawn the same way.

    Args:
        df: tidy table with ``dlcl_weight`` rows; not modified.
        run: run name; overrides ``variant``.
        variant: variant whose single run is drawn.
        stack: ``"encoder"`` or ``"decoder"``, or a foreign model's block list (default: the
            table's only stack; in a zoo encoder–decoder table, the paper's stack).
        step: step or ``"first"`` / ``"last"`` (default: the trained model).
        site: the mixer's site, needed only when the stack has several.
        abs_threshold: absolute masking threshold.
        rel_threshold: masking threshold relative to the row's largest |w|.
        vlim: colour scale is fixed to [-vlim, vlim] so panels compare (give the largest
            |w| of the panels drawn side by side).
        cmap: diverging colormap name.
        ax: Axes to draw on.
        title: first title line.

    Returns:
        The Axes; ``ax.collections[0]`` is the mesh with the masked cells masked.
    """
    stack = S.stack_of(df, stack, quantity="dlcl_weight", zoo_default="encoder", caller="dlcl_heatmap")
    mat, name, resolved = _one_matrix(df, "dlcl_weight", run, variant, stack, step, site)
    mask = S.dlcl_mask(mat, abs_threshold, rel_threshold)
    ax = _style.get_ax(ax)
    ax.set_facecolor("0.8")  # (masked cells show the Axes: grey, unlike W = 0, which the colormap draws white)
    sns.heatmap(mat, mask=mask, vmin=-vlim, vmax=vlim, cmap=cmap, ax=ax, square=True,
                xticklabels=_labels(mat.shape[1]), yticklabels=list(range(mat.shape[0])),
                cbar_kws={"label": "W[r, k]"})
    ax.tick_params(axis="y", labelrotation=0)
    ax.set_xlabel("source output k ($y_0$ = embedding)")
    ax.set_ylabel("row r (input of layer r+1; r = L: stack output)")
    rule = (f"grey: masked (|w| < {abs_threshold:g} or |w| < {rel_threshold:.0%} of row max |w|) "
            "or not recorded (above the diagonal)")
    return _style.finish(ax, title, [f"{name} · {stack}", f"step {resolved}"], rule=rule)


def dlcl_column(
    df: pd.DataFrame,
    *,
    column: int = 10,
    run: str | None = None,
    variant: str | None = None,
    stack: str | None = None,
    step: StepSpec | Sequence[int] = "last",
    site: str | None = None,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """One column W[:, k] of the DLCL weights over consumer rows r ≥ k (Wang 2019 Fig. 5c).

    Args:
        df: tidy table with ``dlcl_weight`` rows; not modified.
        column: k, the layer output whose weights are drawn (the paper's y_10).
        run: run name; overrides ``variant``.
        variant: variant whose single run is drawn.
        stack: ``"encoder"`` or ``"decoder"``, or a foreign model's block list (default: the
            table's only stack; in a zoo encoder–decoder table, the paper's stack).
        step: a step, ``"first"`` / ``"last"`` (default), or a sequence of steps for one
            line per step (the column's change over training).
        site: the mixer's site, needed only when the stack has several.
        ax: Axes to draw on.
        title: first title line.

    Returns:
        The Axes, one line per step: x = the rows r holding a value (r ≥ k for DLCL),
        y = W[r, k]; no masking.

    Raises:
        ValueError: the column is outside the matrix, or no rows.
    """
    steps = [step] if isinstance(step, (int, str)) else list(step)
    stack = S.stack_of(df, stack, quantity="dlcl_weight", zoo_default="encoder", caller="dlcl_column")
    ax = _style.get_ax(ax)
    name = ""
    for s in steps:
        mat, name, resolved = _one_matrix(df, "dlcl_weight", run, variant, stack, s, site)
        if not 0 <= column < mat.shape[1]:
            raise ValueError(f"column {column} outside W of shape {mat.shape}")
        r = np.flatnonzero(np.isfinite(mat[:, column]))
        ax.plot(r.astype(float), mat[r, column], marker="o", label=f"step {resolved}")
    ax.set_xlabel("row r (input of layer r+1; r = L: stack output)")
    ax.set_ylabel(f"W[r, {column}] (weight of $y_{{{column}}}$)")
    _style.integer_x(ax)
    _style.legend(ax)
    return _style.finish(ax, title, [f"{name} · {stack}", f"column k = {column}", "no masking"])
