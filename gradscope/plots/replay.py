"""Spike replay (issue 26): the watch's series, and where the gradient jumped in the replayed step."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes

from gradscope.plots import _style


def spike_watch(watch: pd.DataFrame, *, ax: Axes | None = None, title: str | None = None) -> Axes:
    """The watch's two series over steps (log y), flagged steps marked.

    Args:
        watch: one row per step with ``step``, ``loss``, ``grad_norm`` and ``flagged``
            (the readings of ``rec.watch``); not modified.
        ax: where to draw (default: the current Axes).
        title: first line of the title (preset...).

    Returns:
        The Axes: ``ax.lines[0]`` the loss, ``ax.lines[1]`` ‖g‖, ``ax.lines[2]`` the flagged steps' ‖g‖.
    """
    ax = _style.get_ax(ax)
    ax.plot(watch.step, watch.loss, label="loss (as backpropagated)")
    ax.plot(watch.step, watch.grad_norm, label="total gradient norm ‖g‖")
    hit = watch[watch.flagged.astype(bool)]
    ax.plot(hit.step, hit.grad_norm, "v", color="red", markersize=9, label="flagged and replayed")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("value (log)")
    _style.legend(ax)
    return _style.finish(ax, title, [f"{len(hit)} step(s) flagged: {hit.step.tolist()}"])


def replay_profile(df: pd.DataFrame, *, step: int, neighbours: Sequence[int], quantity: str = "act_grad_norm",
                   role: str = "layer_out", ratio: bool = False, ax: Axes | None = None,
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
            far each layer's gradient jumped).
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
    if ratio:
        base = np.exp(np.log(per[list(neighbours)]).mean(axis=1))
        ax.plot(per.index, per[step] / base, marker="o", label=f"{quantity}: step {step} / neighbours")
        ax.set_ylabel(f"{quantity}(step {step}) / geometric mean of steps {list(neighbours)}")
    else:
        for s in (*neighbours, step):
            ax.plot(per.index, per[s], marker="o" if s == step else ".",
                    label=f"step {s}" + (" (replayed)" if s == step else ""))
        ax.set_ylabel(f"{quantity} at {role}, log")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    _style.legend(ax)
    return _style.finish(ax, title, [f"replayed step {step}, neighbours {list(neighbours)}"])
