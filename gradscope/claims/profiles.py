"""Claims about per-layer quantities: Takase (2022) Fig. 3 and Fig. 4/7, Wang (2019) §5,
Xu (2020) Table 2.

Each rule's margin (``Verdict.margin``, > 0 in the claim's direction) is a log ratio for a
ratio of gradient norms and a difference otherwise; ``gradscope.claims.seeds`` decides over
seeds with it. g(site) below is ``act_grad_norm`` at that site, one value per point
(:func:`gradscope.table.select.one_per_point`), at the chosen step of the run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from gradscope.claims.verdict import Verdict, not_measured, verdict
from gradscope.table import select as S
from gradscope.table.select import StepSpec

FIG3 = "Takase 2022 Fig. 3"


def _log_margin(bound: float, value: float) -> float:
    """``log(bound / value)``: > 0 when ``value < bound``, in multiplicative units (so seeds
    whose ratios differ by a factor scatter alike at any size)."""
    return float(np.log(bound) - np.log(value)) if bound > 0 and value > 0 else float("nan")


def _out_profile(df: pd.DataFrame, variant: str, stack: str, step: StepSpec) -> pd.Series:
    """g(layer output) per layer of the variant's single run (empty if absent)."""
    data = S.single_run(S.rows(df, quantity="act_grad_norm", stack=stack, role="layer_out"), variant=variant)
    data, _ = S.at_step(data, step)
    return S.layer_series(S.one_per_point(data))


def _bottom_over_top(df: pd.DataFrame, variant: str, stack: str, step: StepSpec) -> float | None:
    prof = _out_profile(df, variant, stack, step)
    return None if len(prof) < 2 else float(prof.iloc[0] / prof.iloc[-1])


def takase_fig3_post_ln_vanishing(
    df: pd.DataFrame, *, variant: str = "post_ln", stack: str = "decoder", step: StepSpec = "first",
    max_ratio: float = 1.0, preset: str = "",
) -> Verdict:
    """Takase (2022) Fig. 3b: Post-LN decoder gradient norms shrink toward shallow layers.

    Rule: ``g(layer 1 out) / g(layer L out) < max_ratio`` (default 1) at ``step``
    (default the run's first step, "beginning of training").
    """
    claim = f"{variant} {stack} gradient norms shrink toward shallow layers (vanishing)"
    metric = f"g(layer 1 out) / g(layer L out) < {max_ratio:g}, step {step}"
    ratio = _bottom_over_top(df, variant, stack, step)
    if ratio is None:
        return not_measured(FIG3, claim, metric, preset=preset, detail=f"no {variant} {stack} layer profile")
    return verdict(FIG3, claim, metric, {"bottom/top": ratio}, ratio < max_ratio, preset=preset,
                   margin=_log_margin(max_ratio, ratio))


def takase_fig3_pre_ln_decay(
    df: pd.DataFrame, *, variant: str = "pre_ln", stack: str = "decoder", step: StepSpec = "first",
    max_ratio: float = 1.0, preset: str = "",
) -> Verdict:
    """Takase (2022) Fig. 3 / §4: Pre-LN gradient norms shrink toward deep layers.

    Rule: ``g(layer L out) / g(layer 1 out) < max_ratio`` (default 1).
    """
    claim = f"{variant} {stack} gradient norms shrink toward deep layers"
    metric = f"g(layer L out) / g(layer 1 out) < {max_ratio:g}, step {step}"
    ratio = _bottom_over_top(df, variant, stack, step)
    if ratio is None:
        return not_measured(FIG3, claim, metric, preset=preset, detail=f"no {variant} {stack} layer profile")
    top_over_bottom = 1.0 / ratio if ratio != 0 else float("inf")
    return verdict(FIG3, claim, metric, {"top/bottom": top_over_bottom}, top_over_bottom < max_ratio,
                   preset=preset, margin=_log_margin(max_ratio, top_over_bottom))


def takase_fig3_b2t_mitigates(
    df: pd.DataFrame, *, variant: str = "b2t", baseline: str = "post_ln", stack: str = "decoder",
    step: StepSpec = "first", preset: str = "",
) -> Verdict:
    """Takase (2022) Fig. 3b / §5: the B2T connection mitigates Post-LN's decay.

    Rule: ``bottom/top(b2t) > bottom/top(post_ln)`` with bottom/top =
    ``g(layer 1 out) / g(layer L out)``: B2T's shallow layers keep more of the gradient.
    """
    claim = f"{variant} mitigates {baseline}'s gradient decay toward shallow {stack} layers"
    metric = f"g(1)/g(L) of {variant} > g(1)/g(L) of {baseline}, step {step}"
    ours, base = _bottom_over_top(df, variant, stack, step), _bottom_over_top(df, baseline, stack, step)
    if ours is None or base is None:
        missing = [v for v, r in ((variant, ours), (baseline, base)) if r is None]
        return not_measured(FIG3, claim, metric, preset=preset, detail=f"no layer profile for {missing}")
    return verdict(FIG3, claim, metric, {f"{variant} bottom/top": ours, f"{baseline} bottom/top": base},
                   ours > base, preset=preset, margin=_log_margin(ours, base))


def takase_fig4_ln_drops(
    df: pd.DataFrame, *, layers: Sequence[int] | None = None, variant: str = "post_ln",
    stack: str = "decoder", step: StepSpec = "first", max_ratio: float = 1.0, preset: str = "",
) -> Verdict:
    """Takase (2022) Fig. 4/7: backward through each LN shrinks the gradient norm.

    Rule, at every chosen layer: ``g(1)/g(2) < max_ratio`` (through LN1) and
    ``g(3)/g(4) < max_ratio`` (through LN2), locations as in ``select.LOCATIONS``.
    ``layers`` defaults to ``select.default_layers(L)`` = (1, L // 2, L), the paper's
    (1, 9, 18) at 18 layers. Any missing location makes the claim not measured.
    """
    figure = "Takase 2022 Fig. 4/7"
    claim = f"{variant} {stack}: the gradient norm drops through LN1 (2)→(1) and LN2 (4)→(3)"
    data = S.single_run(S.rows(df, quantity="act_grad_norm", stack=stack), variant=variant)
    data, _ = S.at_step(data, step)
    points = S.one_per_point(data)
    depth = S.layer_depth(points, stack) if len(points) else None
    chosen = tuple(layers) if layers is not None else S.default_layers(depth or 0)
    metric = f"g(1)/g(2) < {max_ratio:g} and g(3)/g(4) < {max_ratio:g} at layers {list(chosen)}, step {step}"
    if depth is None:
        return not_measured(figure, claim, metric, preset=preset, detail=f"no {variant} {stack} rows")
    values: dict[str, float] = {}
    for layer in chosen:
        g = S.location_values(points, layer)
        if np.isnan(g[:4]).any():
            return not_measured(figure, claim, metric, preset=preset,
                                detail=f"locations (1)-(4) incomplete at layer {layer}")
        values[f"L{layer} g1/g2"] = g[0] / g[1]
        values[f"L{layer} g3/g4"] = g[2] / g[3]
    return verdict(figure, claim, metric, values, all(v < max_ratio for v in values.values()),
                   preset=preset, margin=min(_log_margin(max_ratio, v) for v in values.values()))


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (Pearson correlation of average ranks)."""
    rx, ry = pd.Series(x).rank().to_numpy(), pd.Series(y).rank().to_numpy()
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def wang_embed_grad_vanishes(
    df: pd.DataFrame, *, variant: str = "post_ln", stack: str = "encoder", step: StepSpec = "first",
    min_depths: int = 3, max_ratio: float = 1.0, preset: str = "",
) -> Verdict:
    """Wang (2019) §5: Post-LN's embedding-output gradient norm approaches 0 as depth grows.

    Over the variant's runs (depth of a run = its largest ``layer`` in ``stack``; runs of
    equal depth averaged): rule ``spearman(depth, g(embed.out)) < 0`` and
    ``g(deepest) / g(shallowest) < max_ratio``, with at least ``min_depths`` depths.
    """
    figure, claim = "Wang 2019 §4.2", f"{variant} {stack} embedding gradient norm decreases with depth"
    metric = (f"spearman(depth, g({stack}.embed.out)) < 0 and g(deepest)/g(shallowest) < {max_ratio:g}, "
              f">= {min_depths} depths, step {step}")
    by_depth: dict[int, list[float]] = {}
    for run, run_rows in S.rows(df, variant=variant).groupby("run", sort=True):
        depth = S.layer_depth(run_rows, stack)
        emb = S.rows(run_rows, quantity="act_grad_norm", stack=stack, role="embed")
        emb, _ = S.at_step(emb, step)
        if depth is not None and len(emb):
            by_depth.setdefault(depth, []).append(float(S.one_per_point(emb)["value"].iloc[0]))
    if len(by_depth) < min_depths:
        return not_measured(figure, claim, metric, preset=preset,
                            detail=f"{len(by_depth)} depth(s) {sorted(by_depth)}, need {min_depths}")
    depths = np.array(sorted(by_depth), dtype=float)
    grads = np.array([np.mean(by_depth[int(d)]) for d in depths])
    rho, ratio = _spearman(depths, grads), grads[-1] / grads[0]
    values = {"spearman": rho, "deepest/shallowest": ratio, "shallowest depth": depths[0],
              "deepest depth": depths[-1]}
    return verdict(figure, claim, metric, values, rho < 0 and ratio < max_ratio, preset=preset,
                   margin=min(-rho, _log_margin(max_ratio, ratio)))


def _w_over_sigma(df: pd.DataFrame, run: str | None, variant: str | None, stack: str | None,
                  step: StepSpec) -> np.ndarray:
    data = S.single_run(S.rows(df, quantity="ln_w_over_sigma", stack=stack), run=run,
                        variant=None if run is not None else variant)
    data, _ = S.at_step(data, step)
    return S.one_per_point(data)["value"].to_numpy(dtype=float)


def xu_table2_post_ln_shrinks(
    df: pd.DataFrame, *, run: str | None = None, variant: str = "post_ln", stack: str | None = None,
    step: StepSpec = "first", max_mean: float = 1.0, preset: str = "",
) -> Verdict:
    """Xu (2020) Table 2: Post-LN's w/σ sits below 1, so each LN shrinks the residual.

    Rule: mean over the run's norms (``stack`` None = all) of ``ln_w_over_sigma`` < ``max_mean``.
    """
    figure, name = "Xu 2020 Table 2", run or variant
    claim = f"{name}: mean LN w/σ is below 1 (LN shrinks the residual)"
    metric = f"mean_norms(w/σ) < {max_mean:g}, step {step}"
    vals = _w_over_sigma(df, run, variant, stack, step)
    if not len(vals):
        return not_measured(figure, claim, metric, preset=preset,
                            detail=f"no ln_w_over_sigma rows for {name}")
    mean = float(np.mean(vals))
    return verdict(figure, claim, metric, {"mean w/σ": mean, "norms": len(vals)}, mean < max_mean,
                   preset=preset, margin=max_mean - mean)


def xu_table2_lipschitz_closer(
    df: pd.DataFrame, *, baseline_run: str, lipschitz_run: str, stack: str | None = None,
    step: StepSpec = "first", preset: str = "",
) -> Verdict:
    """Xu (2020) §3.2 / Table 2: Lipschitz init keeps post_ln's w/σ closer to 1.

    Rule: ``mean_norms |1 - w/σ|`` of ``lipschitz_run`` < that of ``baseline_run`` (both
    post_ln runs; the table has no init column, so runs are named).
    """
    figure = "Xu 2020 Table 2"
    claim = f"{lipschitz_run}'s w/σ is closer to 1 than {baseline_run}'s"
    metric = f"mean_norms |1 - w/σ| of {lipschitz_run} < that of {baseline_run}, step {step}"
    lip = _w_over_sigma(df, lipschitz_run, None, stack, step)
    base = _w_over_sigma(df, baseline_run, None, stack, step)
    if not len(lip) or not len(base):
        missing = [r for r, v in ((lipschitz_run, lip), (baseline_run, base)) if not len(v)]
        return not_measured(figure, claim, metric, preset=preset,
                            detail=f"no ln_w_over_sigma rows for {missing}")
    d_lip, d_base = float(np.mean(np.abs(1 - lip))), float(np.mean(np.abs(1 - base)))
    return verdict(figure, claim, metric, {"lipschitz |1-w/σ|": d_lip, "baseline |1-w/σ|": d_base},
                   d_lip < d_base, preset=preset, margin=d_base - d_lip)


COLLAPSE = 1e-2  # "approaches 0": two orders of magnitude below the shallow run's


def _embed_series(df: pd.DataFrame, run: str, stack: str) -> pd.Series:
    rows = S.rows(df, quantity="act_grad_norm", stack=stack, role="embed", run=run)
    points = S.one_per_point(rows)
    return points.groupby("step")["value"].mean().sort_index()


def wang_embed_grad_collapses_in_training(
    df: pd.DataFrame, *, deep: str, shallow: str, stack: str = "encoder", max_ratio: float = COLLAPSE,
    preset: str = "",
) -> Verdict:
    """Wang (2019) §4.2: in a deep Post-LN run that fails to train, the embedding-layer
    gradient norm approaches 0 (one seed).

    Rule: over the last quarter of the steps both runs recorded in training (step > 0),
    ``R = geomean g(deep embed.out) / geomean g(shallow embed.out) < max_ratio`` (default
    1e-2: two orders of magnitude, fixed before any run). Margin ``log(max_ratio / R)``.
    """
    figure, claim = "Wang 2019 §4.2", f"the deep post_ln run's {stack} embedding gradient approaches 0 in training"
    metric = (f"geomean g({stack}.embed.out) of {deep} / that of {shallow} < {max_ratio:g} over the last quarter "
              "of the trained steps")
    series = {r: _embed_series(df, r, stack) for r in (deep, shallow)}
    steps = sorted(set(series[deep].index[series[deep].index > 0]) & set(series[shallow].index[series[shallow].index > 0]))
    if len(steps) < 4:
        return not_measured(figure, claim, metric, preset=preset,
                            detail=f"{len(steps)} trained steps recorded in both runs, need >= 4")
    tail = steps[len(steps) - max(1, len(steps) // 4):]
    geo = {r: float(np.exp(np.log(series[r].loc[tail].to_numpy(dtype=float)).mean())) for r in (deep, shallow)}
    ratio = geo[deep] / geo[shallow]
    values = {"deep/shallow": ratio, "deep at init": float(series[deep].iloc[0]), "deep, last steps": geo[deep],
              "shallow, last steps": geo[shallow], "last step": float(steps[-1])}
    return verdict(figure, claim, metric, values, ratio < max_ratio, preset=preset, margin=_log_margin(max_ratio, ratio))
