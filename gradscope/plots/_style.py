"""Axis labels with units, figure notes and shared drawing helpers for :mod:`gradscope.plots`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, MaxNLocator
from matplotlib.transforms import blended_transform_factory

LOSS_UNIT = "nats"
"""Unit of a loss when the table does not say otherwise (natural-log cross-entropy)."""

_UNITS = {"e": "nats", "2": "bits", "10": "log10 units"}


def loss_unit(df: pd.DataFrame) -> str:
    """Loss unit from ``df.attrs["loss_log_base"]`` (set by ``gradscope.train``), default nats."""
    base = str(df.attrs.get("loss_log_base", "e"))
    return _UNITS.get(base, f"log base {base}")

FAILED_LABEL = "failed / non-finite (marked at top edge)"


def get_ax(ax: Axes | None) -> Axes:
    """``ax``, or the current Axes of pyplot (seaborn's convention)."""
    return plt.gca() if ax is None else ax


def quantity_label(quantity: str, reduction: str, unit: str = LOSS_UNIT) -> str:
    """Axis label with units for a table quantity.

    Args:
        quantity: table quantity.
        reduction: from ``select.reduction_text``.
        unit: loss unit from :func:`loss_unit`.
    """
    loss = f"loss: {reduction}, {unit}"
    labels = {
        "act_grad_norm": f"‖∂L/∂h‖₂ ({loss})",
        "param_grad_norm": f"‖∂L/∂θ‖₂ ({loss})",
        "ln_gain": "‖∂L/∂x_in‖₂ / ‖∂L/∂x_out‖₂ (ratio)",
        "ln_w_over_sigma": "mean w/σ (dimensionless)",
        "scalenorm_g": "ScaleNorm g (dimensionless)",
        "update_ratio": "‖Δθ‖₂/‖θ‖₂ (ratio)",
        "loss": f"training loss ({unit}, {reduction})",
        "val_loss": f"validation loss ({unit}, {reduction})",
        "lr": "learning rate",
        "cosine": "cosine similarity",
        "dlcl_weight": "DLCL weight W[r, k]",
    }
    return labels.get(quantity, quantity)


def step_note(steps: Mapping[str, int]) -> str:
    """'step 0' when every run shares a step, else 'steps: run=s, ...'."""
    distinct = sorted(set(steps.values()))
    if len(distinct) == 1:
        return f"step {distinct[0]}"
    return "steps: " + ", ".join(f"{r}={s}" for r, s in sorted(steps.items()))


def finish(ax: Axes, title: str | None, notes: Iterable[str], rule: str = "") -> Axes:
    """Sets the title: the caller's ``title`` (preset...), a line of automatic notes (step,
    averaging), and a line stating ``rule`` (masking) when given."""
    note = " · ".join(n for n in notes if n)
    ax.set_title("\n".join(t for t in (title, note, rule) if t), fontsize="medium")
    for axis in (ax.xaxis, ax.yaxis):  # steps and layers are whole numbers: no 2.5 on their ticks
        if axis.get_label_text().startswith(("step", "layer")) and not isinstance(axis.get_major_locator(), FixedLocator):
            axis.set_major_locator(MaxNLocator(integer=True))
    return ax


def integer_x(ax: Axes) -> None:
    """Integer ticks on the x axis (layers, steps, depths)."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def averaged_note(n_max: int) -> str:
    """Note that points were averaged over micro-batches/ranks, empty when nothing was."""
    return f"mean over up to {n_max} micro-batches/ranks" if n_max > 1 else ""


def mark_top_edge(ax: Axes, xs: Iterable[float], color: str) -> Line2D:
    """Draws x markers at data x positions on the top edge of ``ax`` (failed runs)."""
    xs = list(xs)
    trans = blended_transform_factory(ax.transData, ax.transAxes)
    (line,) = ax.plot(xs, [1.0] * len(xs), linestyle="none", marker="x", markersize=9,
                      markeredgewidth=2, color=color, transform=trans, clip_on=False,
                      label="_failed")
    return line


def failed_legend_handle() -> Line2D:
    """Legend proxy for :func:`mark_top_edge` markers."""
    return Line2D([], [], linestyle="none", marker="x", color="black", markeredgewidth=2,
                  label=FAILED_LABEL)


def legend(ax: Axes, extra: Iterable[Line2D] = (), title: str | None = None) -> None:
    """Legend of the labelled lines plus ``extra`` proxy handles."""
    handles, labels = ax.get_legend_handles_labels()
    extra = list(extra)
    if handles or extra:
        ax.legend(handles=[*handles, *extra], labels=[*labels, *(h.get_label() for h in extra)],
                  title=title, fontsize="small")
