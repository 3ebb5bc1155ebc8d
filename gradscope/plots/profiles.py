"""Per-layer profiles: a value against layer index, one line per hue level.

Takase (2022) Fig. 3 and Fig. 4/7, Wang (2019) §5 (embedding gradient, layer 0),
Xu (2020) Table 2 (w/σ), Nguyen & Salazar (2019) (ScaleNorm g vs depth).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes

from gradscope.plots import _style
from gradscope.table import select as S
from gradscope.table.select import StepSpec


def _points(df: pd.DataFrame, step: StepSpec, what: str) -> tuple[pd.DataFrame, dict[str, int]]:
    data, steps = S.at_step(df, step)
    if data.empty:
        raise ValueError(f"no rows for {what} at step {step!r}")
    return S.one_per_point(data), steps


def _draw_profiles(
    ax: Axes, points: pd.DataFrame, hue: str, hue_order: Sequence[str] | None, colors: Sequence | None = None
) -> None:
    """One line per hue level: x = layer, y = mean over that layer's sites (``colors``: one
    per level, default the colour cycle)."""
    S.check_one_run_per_hue(points, hue)
    for k, level in enumerate(S.hue_values(points, hue, hue_order)):
        series = S.layer_series(points.loc[points[hue] == level])
        ax.plot(series.index.to_numpy(dtype=float), series.to_numpy(), marker="o",
                markersize=3, label=level, color=colors[k] if colors is not None else None)


def layer_norms(
    df: pd.DataFrame,
    *,
    quantity: str = "act_grad_norm",
    stack: str | None = None,
    role: str = "layer_out",
    include_embed: bool = False,
    hue: str = "variant",
    hue_order: Sequence[str] | None = None,
    step: StepSpec = "first",
    logy: bool = True,
    ax: Axes | None = None,
    title: str | None = None,
    colors: Sequence | None = None,
) -> Axes:
    """Value at the ``role`` sites of each layer of ``stack`` against layer (Takase 2022 Fig. 3).

    Works alike for zoo stacks (``"decoder"``) and blocks found in other models
    (``"transformer.h"``): sites are chosen by the table's ``role`` column.

    Args:
        df: tidy table (``gradscope.table``); not modified.
        quantity: table quantity, default the activation-gradient norm.
        stack: ``"encoder"``, ``"decoder"``, or a foreign model's block list (default: the
            table's only stack; in a zoo encoder–decoder table, ``"decoder"``).
        role: which sites of a layer: ``"layer_out"`` (default), ``"layer_in"``, ``"sum"``,
            ``"norm_in"``... (``gradscope.table``); a layer with several such sites (one
            ``sum`` per sub-layer) is drawn at their mean.
        include_embed: also draw the embedding output (role ``embed``) at layer 0 (Wang 2019 §5).
        hue: column giving one line per value (each value must be one run): ``variant``,
            ``run``, ``stack`` or ``site``.
        hue_order: order of the lines; default sorted.
        step: step, or ``"first"`` (default: start of training, as in Takase Fig. 3) or
            ``"last"``, resolved per run.
        logy: log-scaled y axis.
        ax: Axes to draw on; default the current one.
        title: first title line (preset, model size); the step follows automatically.
        colors: a colour per line in ``hue_order`` (default: the colour cycle).

    Returns:
        The Axes.

    Raises:
        ValueError: no matching rows, or a hue value covers several runs.
    """
    roles = (role, "embed") if include_embed else (role,)
    stack = S.stack_of(df, stack, quantity=quantity, zoo_default="decoder", caller="layer_norms")
    data = S.rows(df, quantity=quantity, stack=stack, role=roles)
    points, steps = _points(data, step, f"{quantity} at {stack} sites of role {' or '.join(roles)}")
    ax = _style.get_ax(ax)
    _draw_profiles(ax, points, hue, hue_order, colors)
    ax.set_xlabel("layer (0 = embedding output)" if include_embed else "layer")
    _style.integer_x(ax)
    ax.set_ylabel(_style.quantity_label(quantity, S.reduction_text(points), _style.loss_unit(df)))
    if logy:
        ax.set_yscale("log")
    _style.legend(ax, title=hue)
    return _style.finish(ax, title, [f"{stack} · {role} sites", _style.step_note(steps),
                                     _style.averaged_note(int(points["n"].max()))])


def location_norms(
    df: pd.DataFrame,
    *,
    layers: Sequence[int] | None = None,
    run: str | None = None,
    variant: str | None = "post_ln",
    quantity: str = "act_grad_norm",
    stack: str | None = None,
    step: StepSpec = "first",
    logy: bool = True,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Gradient norm at Takase (2022) Fig. 4/7 locations (1)-(5), one line per layer.

    x is the location 1..5 (``select.LOCATIONS``): a backward pass crosses LN1 going
    (2)→(1) and LN2 going (4)→(3). Absent locations (no cross-attention) are NaN gaps.

    Args:
        df: tidy table; not modified.
        layers: 1-based layers to draw; default ``select.default_layers(depth)``, i.e.
            (1, L // 2, L) — the paper's (1, 9, 18) at 18 layers.
        run: run name; overrides ``variant`` as the selector.
        variant: variant whose single run is drawn (default ``post_ln``).
        quantity: table quantity.
        stack: stack holding the layers (default: the table's only stack; in a zoo
            encoder–decoder table, ``"decoder"``).
        step: step or ``"first"`` (default) / ``"last"``.
        logy: log-scaled y axis.
        ax: Axes to draw on.
        title: first title line.

    Returns:
        The Axes.

    Raises:
        ValueError: no rows, several runs selected, or a requested layer is absent.
    """
    stack = S.stack_of(df, stack, quantity=quantity, zoo_default="decoder", caller="location_norms")
    data = S.single_run(S.rows(df, quantity=quantity, stack=stack), run=run,
                        variant=None if run is not None else variant)
    points, steps = _points(data, step, f"{quantity} in {stack} of {run or variant}")
    depth = S.layer_depth(points, stack)
    chosen = tuple(layers) if layers is not None else S.default_layers(depth or 0)
    present = set(points["layer"].dropna().astype(int))
    missing = [i for i in chosen if i not in present]
    if missing:
        raise ValueError(f"layers {missing} not in the data (layers present: {sorted(present)})")
    ax = _style.get_ax(ax)
    x = np.arange(1, len(S.LOCATIONS) + 1, dtype=float)
    for layer in chosen:
        ax.plot(x, S.location_values(points, layer), marker="o", label=f"layer {layer}")
    ax.set_xticks(x, [label for _, _, label in S.LOCATIONS])
    ax.set_xlabel(f"location in {stack} layer (Takase 2022 Fig. 4)")
    ax.set_ylabel(_style.quantity_label(quantity, S.reduction_text(points), _style.loss_unit(df)))
    if logy:
        ax.set_yscale("log")
    _style.legend(ax)
    return _style.finish(ax, title, [str(points["run"].iloc[0]), _style.step_note(steps),
                                     _style.averaged_note(int(points["n"].max()))])


def _norm_profile(
    df: pd.DataFrame, quantity: str, stack: str | None, hue: str, hue_order: Sequence[str] | None,
    step: StepSpec, ax: Axes | None, title: str | None, reference: tuple[float, str] | None,
) -> Axes:
    """Per-norm quantity averaged per layer (sites opaque; the ``layer`` column is x), with an
    optional dashed ``(value, label)`` reference line."""
    stack = S.stack_of(df, stack, quantity=quantity, zoo_default="encoder", caller=quantity)
    data = S.rows(df, quantity=quantity, stack=stack)
    points, steps = _points(data.loc[data["layer"].notna()], step, f"{quantity} in {stack}")
    ax = _style.get_ax(ax)
    _draw_profiles(ax, points, hue, hue_order)
    ax.set_xlabel("layer")
    _style.integer_x(ax)
    ax.set_ylabel(_style.quantity_label(quantity, S.reduction_text(points), _style.loss_unit(df)))
    if reference is not None:
        ax.axhline(reference[0], color="gray", linestyle="--", linewidth=1, label=reference[1])
    _style.legend(ax, title=hue)
    return _style.finish(ax, title, [stack, "mean over the layer's norms", _style.step_note(steps),
                                     _style.averaged_note(int(points["n"].max()))])


def w_over_sigma(
    df: pd.DataFrame,
    *,
    stack: str | None = None,
    hue: str = "run",
    hue_order: Sequence[str] | None = None,
    step: StepSpec = "first",
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Mean LayerNorm w/σ per layer with a reference line at 1 (Xu 2020 Table 2).

    Below 1, a Post-LN norm shrinks the residual it normalises. Several norms in one layer
    are averaged (stated on the figure); stack-level norms (``layer`` NA) are left out.

    Args:
        df: tidy table with ``ln_w_over_sigma`` rows; not modified.
        stack: ``"encoder"`` or ``"decoder"``, or a foreign model's block list (default: the
            table's only stack; in a zoo encoder–decoder table, ``"encoder"``).
        hue: column for one line per value; default ``run`` (post_ln with two inits are
            the same variant).
        hue_order: order of the lines.
        step: step or ``"first"`` (default: at init) / ``"last"``.
        ax: Axes to draw on.
        title: first title line.

    Returns:
        The Axes; the reference line is the last line, labelled ``"w/σ = 1"``.
    """
    return _norm_profile(df, "ln_w_over_sigma", stack, hue, hue_order, step, ax, title, (1.0, "w/σ = 1"))


def scalenorm_g(
    df: pd.DataFrame,
    *,
    stack: str | None = None,
    hue: str = "run",
    hue_order: Sequence[str] | None = None,
    step: StepSpec = "last",
    init_g: float | None = None,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Learned ScaleNorm g against depth (Nguyen & Salazar 2019).

    Several norms in one layer are averaged; the final norm (``layer`` NA) is left out.

    Args:
        df: tidy table with ``scalenorm_g`` rows; not modified.
        stack: ``"encoder"`` or ``"decoder"``, or a foreign model's block list (default: the
            table's only stack; in a zoo encoder–decoder table, ``"encoder"``).
        hue: column for one line per value.
        hue_order: order of the lines.
        step: step or ``"first"`` / ``"last"`` (default: after training).
        init_g: g at initialisation (√d), drawn as a dashed reference line when given.
        ax: Axes to draw on.
        title: first title line.

    Returns:
        The Axes; the reference line, when drawn, is the last line, labelled ``"init g = √d"``.
    """
    reference = None if init_g is None else (init_g, "init g = √d")
    return _norm_profile(df, "scalenorm_g", stack, hue, hue_order, step, ax, title, reference)


def embed_grad_vs_depth(
    df: pd.DataFrame,
    runs: Sequence[str],
    *,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """‖∂L/∂h‖₂ at ``encoder.embed.out`` against encoder depth, one point per run (Wang 2019 §5).

    Args:
        df: tidy table with ``act_grad_norm`` rows; each run's first step is drawn (at
            initialisation, as Wang §5); not modified.
        runs: the runs of the depth sweep (each run's depth is its number of encoder layers).
        ax: Axes to draw on.
        title: first title line.

    Returns:
        The Axes (linear y from 0: the values of a sweep differ by tens of %, which a log axis
        over their range would draw as a collapse).
    """
    ax = _style.get_ax(ax)
    data = S.rows(df, quantity="act_grad_norm", stack="encoder", role="embed")
    data, steps = _points(data.loc[data["run"].isin(runs)], "first", "act_grad_norm at encoder.embed.out")
    depth = {r: S.layer_depth(S.rows(df, run=r), "encoder") for r in runs}
    data = data.assign(depth=data["run"].map(depth)).sort_values("depth")
    variants = sorted(data["variant"].astype(str).unique())
    values = data["value"].to_numpy(float)
    ax.plot(data["depth"].to_numpy(float), values, marker="o", label=" / ".join(variants))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("encoder layers N")
    ax.set_ylabel(_style.quantity_label("act_grad_norm", S.reduction_text(data), _style.loss_unit(df))
                  + " at encoder.embed.out")
    ax.legend(fontsize="small")
    ratio = f"deepest / shallowest = {values[-1] / values[0]:.3g}" if len(values) > 1 and values[0] else ""
    return _style.finish(ax, title, ["encoder.embed.out", _style.step_note(steps), ratio])


GAIN_SUBLAYERS: tuple[tuple[str, str], ...] = (
    ("self_attn", "LN1 (after SA)"), ("cross_attn", "LN2 (after CA)"), ("ffn", "LN3 (after FFN)"))
"""(sub-layer, label) of the norms :func:`ln_gains` draws, in a Post-LN decoder layer's order."""


def ln_gains(
    df: pd.DataFrame,
    *,
    stack: str | None = None,
    step: StepSpec = "first",
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """``ln_gain`` = ‖grad in‖/‖grad out‖ of each in-layer norm against layer (Takase 2022 §3).

    One line per sub-layer's norm (:data:`GAIN_SUBLAYERS` in a zoo model; in another model,
    one line per norm name inside a layer, as ``ln_1``), a dashed line at gain 1; the
    stack's final norm is left out.

    Args:
        df: tidy table with ``ln_gain`` rows of one run; not modified.
        stack: the layer stack (``"encoder"`` or ``"decoder"`` in a zoo model; a foreign
            model's stack is its blocks' path, as ``"transformer.h"``); default: the table's
            only stack, in a zoo encoder–decoder table ``"decoder"``.
        step: step, or ``"first"`` (default: at initialisation, as Takase §3) or ``"last"``.
        ax: Axes to draw on.
        title: first title line; the step follows automatically.

    Returns:
        The Axes.

    Raises:
        ValueError: no ``ln_gain`` rows of ``stack``'s layers (naming the stacks that have some).
    """
    stack = S.stack_of(df, stack, quantity="ln_gain", zoo_default="decoder", caller="ln_gains")
    ax = _style.get_ax(ax)
    gains = S.rows(df, quantity="ln_gain", stack=stack)
    gains = gains.loc[gains["layer"].notna()]  # the layers' norms, not the final norm
    if gains.empty:
        having = sorted(set(S.rows(df, quantity="ln_gain").dropna(subset=["layer"])["stack"]))
        raise ValueError(f"ln_gains: no ln_gain rows of the layers of stack {stack!r}; stacks with some: {having}")
    points, steps = _points(gains, step, f"ln_gain in {stack}")
    part = S.sublayer(points["site"])  # an ln_gain row's site is its norm's module name
    lines = [(part == label, name) for label, name in GAIN_SUBLAYERS if (part == label).any()]
    if not lines:  # not a zoo model: one line per norm name inside a layer (``transformer.h.3.ln_1`` -> ``ln_1``)
        inside = points["site"].str.replace(rf"^{re.escape(stack)}\.(layers\.)?\d+\.", "", regex=True)
        lines = [(inside == name, name) for name in sorted(set(inside))]
    for chosen, name in lines:
        pts = points.loc[chosen].groupby("layer")["value"].mean()
        ax.plot(pts.index.to_numpy(float), pts.to_numpy(float), marker="o", markersize=3, label=name)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="gain = 1")
    ax.set_xlabel(f"{stack} layer")
    _style.integer_x(ax)
    ax.set_ylabel("‖∂L/∂x_in‖₂ / ‖∂L/∂x_out‖₂ of the norm (ratio)")
    ax.legend(fontsize="small")
    return _style.finish(ax, title, [_style.step_note(steps), "below 1: the norm shrinks the gradient"])


def scan_layers(layers: pd.DataFrame, *, ax: Axes | None = None, title: str | None = None) -> Axes:
    """The scan's per-layer gradient norm, one line per stack (``gradscope scan``).

    Args:
        layers: ``ScanResult.layers`` (columns ``stack``, ``layer``, ``act_grad_norm``).
        ax: Axes to draw on.
        title: first title line.

    Returns:
        The Axes (log y).
    """
    ax = _style.get_ax(ax)
    for stack, rows in layers.groupby("stack", sort=False):
        ax.plot(rows.layer, rows.act_grad_norm, marker="o", label=stack or "blocks")
    ax.set_yscale("log")
    ax.set_xlabel("layer (1 = bottom)")
    ax.set_ylabel("‖∂L/∂y_l‖₂ at the layer output (loss: mean over tokens, nats)")
    ax.set_title(f"gradscope scan: {title}\none step on a synthetic batch, before training", fontsize=9)
    ax.legend()
    return ax
