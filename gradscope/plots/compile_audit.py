"""The compile audit's figure: eager against compiled, value by value (:func:`gradscope.compile_audit`)."""

from __future__ import annotations

import pandas as pd
from matplotlib.axes import Axes

from gradscope.plots import _style

FLOOR = 1e-12
"""Relative differences below this (an exact match is 0) are drawn at it, on the log axis."""

_MARKERS = {"forward": "o", "backward": "s", "parameter gradient": "^", "other": "x"}


def compile_audit_profile(table: pd.DataFrame, *, tolerance: float, first=None, ax: Axes | None = None,
                          title: str | None = None) -> Axes:
    """Relative difference |compiled − eager| / max(|eager|, |compiled|) of every audited value,
    in the order the audit searches (forward sites in forward order, then gradients in backward
    order, then parameter groups), one series per phase; the tolerance as a dashed line and the
    first divergence circled and named.

    Args:
        table: ``CompileAudit.table`` (columns ``order``, ``phase``, ``site``, ``quantity``, ``rel_diff``).
        tolerance: the audit's tolerance.
        first: ``CompileAudit.first`` (a :class:`~gradscope.compiled_vs_eager.Divergence`) or None.
        ax: Axes to draw on.
        title: first title line.

    Returns:
        The Axes (log y; differences below ``FLOOR``, exact matches among them, drawn at ``FLOOR``).
    """
    ax = _style.get_ax(ax)
    for phase, rows in table.groupby("phase", sort=False):
        ax.plot(rows.order, rows.rel_diff.clip(lower=FLOOR, upper=1e3), linestyle="none",
                marker=_MARKERS.get(phase, "x"), label=f"{phase} ({rows.quantity.iloc[0]})" if
                rows.quantity.nunique() == 1 else phase)
    ax.axhline(tolerance, color="k", linestyle="--", linewidth=1, label=f"tolerance {tolerance:g}")
    if first is not None:
        at = table[(table.site == first.site) & (table.quantity == first.quantity)].iloc[0]
        ax.plot([at.order], [min(max(at.rel_diff, FLOOR), 1e3)], marker="o", markersize=14, markerfacecolor="none",
                color="red", linestyle="none", label=f"first: {first.quantity} at {first.site or '(model)'}")
    ax.set_yscale("log")
    ax.set_xlabel("value, in computation order (forward sites, then gradients backward, then parameter groups)")
    ax.set_ylabel("|compiled − eager| / max(|eager|, |compiled|)")
    verdict = f"first divergence: {first.quantity} at {first.site or '(model)'}" if first else "no divergence"
    ax.set_title(f"{title or 'compile audit'}\none batch, eager vs torch.compile on the same weights; {verdict}; "
                 f"exact matches drawn at {FLOOR:g}", fontsize=9)
    ax.legend(fontsize=7)
    return ax
