"""Spike replay (issue 26): the watch's series, and where the gradient jumped in the replayed step."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.transforms import blended_transform_factory

from gradscope.plots import _style
from gradscope.table import select as S


def spike_watch(watch: pd.DataFrame, *, ax: Axes | None = None, title: str | None = None) -> Axes:
    """The watch's two series over steps (log y), flagged steps marked.

    Args:
        watch: one row per step with ``step``, ``loss``, ``grad_norm`` and ``flagged``
            (the readings of ``rec.watch``); not modified.
        ax: where to draw (default: the current Axes).
        title: first line of the title (preset...).

    Returns:
        The Axes: ``ax.lines[0]`` the loss, ``ax.lines[1]`` ‖g‖, ``ax.lines[2]`` the flagged
        steps (markers on the top edge, above the spike they flag).
    """
    ax = _style.get_ax(ax)
    ax.plot(watch.step, watch.loss, label="loss (as backpropagated, nats)")
    ax.plot(watch.step, watch.grad_norm, label="total gradient norm ‖g‖₂")
    hit = watch[watch.flagged.astype(bool)]
    top = blended_transform_factory(ax.transData, ax.transAxes)
    ax.plot(hit.step, [1.0] * len(hit), "v", color="red", markersize=9, transform=top, clip_on=False,
            label="flagged and replayed")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats) and ‖g‖₂, log scale")
    _style.legend(ax)
    return _style.finish(ax, title, [f"{len(hit)} step(s) flagged: {hit.step.tolist()}"])


def replay_profile(df: pd.DataFrame, *, step: int, neighbours: Sequence[int], quantity: str = "act_grad_norm",
                   role: str = "layer_out", ratio: bool = False, factor: float | None = None, ax: Axes | None = None,
                   title: str | None = None) -> Axes:
    """Per layer, ``quantity`` at the ``role`` sites in the replayed ``step`` and its recorded neighbours.

    Args:
        df: tidy table of one run (the replayed step and the neighbours recorded by the
            schedule); not modified.
        step: the replayed step.
        neighbours: recorded steps to compare with.
        quantity: table quantity of activation sites (default the activation-gradient norm).
        role: the sites' role (default ``layer_out``: each layer's output).
        ratio: draw value(step) / geometric mean of the neighbours' values instead (how
            far each layer's gradient jumped), on a linear axis.
        factor: with ``ratio``, a reference line at this factor (a spike planted by scaling the loss).
        ax: where to draw.
        title: first line of the title.

    Returns:
        The Axes, one line per step (one line with ``ratio``).
    """
    ax = _style.get_ax(ax)
    rows = df[(df.quantity == quantity) & (df.micro_step == -1) & df.layer.notna() & (df.role == role)]
    per = rows.groupby(["step", "layer"]).value.mean().unstack("step")
    missing = [s for s in (step, *neighbours) if s not in per.columns]
    if missing:
        raise ValueError(f"replay_profile: no {quantity} rows at steps {missing}; recorded: {list(per.columns)}")
    if ratio:  # (linear: the jump is near one factor at every layer, and a log axis would stretch a few %)
        base = np.exp(np.log(per[list(neighbours)]).mean(axis=1))
        ax.plot(per.index, per[step] / base, marker="o", label=f"step {step} / neighbours")
        if factor is not None:
            ax.axhline(factor, color="0.5", linestyle="--", label=f"the planted factor, {factor:g}")
        ax.set_ylabel(f"{quantity}(step {step}) / geometric mean of steps {list(neighbours)} (ratio)")
    else:
        for s in (*neighbours, step):
            ax.plot(per.index, per[s], marker="o" if s == step else ".",
                    label=f"step {s}" + (" (replayed)" if s == step else ""))
        label = _style.quantity_label(quantity, S.reduction_text(rows), _style.loss_unit(df))
        ax.set_ylabel(f"{label} at {role}, log scale")
        ax.set_yscale("log")
    ax.set_xlabel("layer")
    _style.legend(ax)
    return _style.finish(ax, title, [f"replayed step {step}, neighbours {list(neighbours)}"])
