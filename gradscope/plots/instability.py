"""Wortsman et al. 2023's learning-rate sensitivity plot and the signals over training."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes


def lr_sensitivity(summary: pd.DataFrame, *, order: Sequence[str] | None = None, ax: Axes | None = None,
                   title: str | None = None) -> Axes:
    """Final training loss against peak learning rate, one line per setting (Wortsman 2023
    Fig. 1); a diverged run is an x on the top edge at its learning rate.

    Args:
        summary: :func:`gradscope.claims.lr_summary` rows (``setting``, ``lr``, ``final_loss``, ``diverged``).
        order: the settings' order (default: sorted).
        ax: Axes to draw on.
        title: first title line (preset, model size).

    Returns:
        The Axes.
    """
    ax = ax or plt.gca()
    finite = summary.final_loss[np.isfinite(summary.final_loss)]
    top = float(finite.max()) * 1.05 if len(finite) else 1.0
    for k, setting in enumerate(order or sorted(summary.setting.unique())):
        rows = summary[summary.setting == setting].sort_values("lr")
        color = f"C{k}"
        ok = rows[np.isfinite(rows.final_loss)]
        ax.plot(ok.lr, ok.final_loss, marker="o", color=color, label=setting)
        bad = rows[~np.isfinite(rows.final_loss)]
        ax.plot(bad.lr, [top] * len(bad), "x", color=color, markersize=9, clip_on=False)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final training loss (nats, mean over tokens)")
    lines = [title] if title else []
    ax.set_title("\n".join([*lines, "final loss vs learning rate; x on the top edge: diverged (non-finite loss)"]))
    ax.legend(title="setting", fontsize="small")
    return ax


def signal_over_training(df: pd.DataFrame, *, quantity: str, runs: Sequence[str], labels: Sequence[str] | None = None,
                         logy: bool = False, ax: Axes | None = None, title: str | None = None,
                         colors: Sequence[str] | None = None, styles: Sequence[str] | None = None) -> Axes:
    """A per-layer signal over training steps, as the max over layers (``attn_logit_max``)
    or the model's value (``output_logit_log_z``), one line per run.

    Args:
        df: tidy table; not modified.
        quantity: the signal.
        runs: the runs to draw.
        labels: legend labels of ``runs`` (default: the run names).
        logy: log-scaled y axis.
        ax: Axes to draw on.
        title: first title line.
        colors: a colour per run (default: the colour cycle), so that one setting keeps its
            colour across a figure's panels.
        styles: a line style per run (default: solid).

    Returns:
        The Axes.
    """
    ax = ax or plt.gca()
    rows = df[(df.quantity == quantity) & df.layer_j.isna() & (df.micro_step == -1)]
    for k, (run, label) in enumerate(zip(runs, labels or runs)):
        series = rows[rows.run == run].groupby("step").value.max().sort_index()
        ax.plot(series.index, series.to_numpy(), marker=".", label=label,
                color=colors[k] if colors else None, linestyle=styles[k] if styles else "-")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    what = {"attn_logit_max": "max attention logit q·k/√d_head (max over layers and heads)",
            "output_logit_log_z": "log Z of the output logits (mean over tokens, nats)"}.get(quantity, quantity)
    ax.set_ylabel(what)
    ax.set_title("\n".join([*([title] if title else []), f"{quantity} over training (recorded steps)"]))
    ax.legend(fontsize="small")
    return ax
