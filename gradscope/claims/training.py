"""Convergence claims: Takase (2022) Fig. 1/6/9 and Fig. 8, Xu (2020) Tables 1/3,
Wang (2019) Fig. 3, Nguyen & Salazar (2019).

A run *converged* (:func:`run_outcome`) when
  1. none of its ``loss`` / ``val_loss`` points is non-finite and the recorder logged no
     ``nonfinite`` / ``nonfinite_grad`` row for it, and
  2. its best validation loss is at most ``max_fraction`` (default 0.75) of its initial
     loss: ``min(val_loss) <= max_fraction * initial``, where *initial* is the training
     loss at the run's first recorded step (``gradscope.train`` logs step 1's loss, taken
     before the first update, i.e. the untrained model; both losses are label-smoothed
     means over tokens, in nats). Without training-loss rows, the first ``val_loss``.
It *failed* when (1) or (2) is violated; it is undecided (None) when it has no finite
validation loss and did not diverge. The 0.75 (a 25% drop from the untrained loss) was
fixed before any run and is not tuned per preset.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from gradscope.claims.verdict import Verdict, not_measured, verdict
from gradscope.table import SWEEP_COLUMNS
from gradscope.table import select as S

MAX_FRACTION = 0.75


@dataclass(frozen=True)
class RunOutcome:
    """Convergence of one run.

    Attributes:
        run: run name.
        variant: the run's variant.
        initial: the untrained model's loss (nats): first training loss, else first
            validation loss; NaN if none.
        best: lowest finite validation loss (nats), NaN if none.
        diverged_at: first step with a non-finite value, or None.
        converged: True / False, None when undecided (no finite evaluation, no divergence).
    """

    run: str
    variant: str
    initial: float
    best: float
    diverged_at: int | None
    converged: bool | None


def run_outcome(df: pd.DataFrame, run: str, *, quantity: str = "val_loss",
                max_fraction: float = MAX_FRACTION) -> RunOutcome:
    """Decides whether ``run`` converged (rule in the module docstring).

    Args:
        df: tidy table holding the run's ``quantity`` and ``loss`` rows.
        run: run name.
        quantity: loss whose minimum is "best", ``val_loss`` (default) or ``loss``.
        max_fraction: best must be at most this fraction of the initial loss.
    """
    run_rows = S.rows(df, run=run)
    variant = str(run_rows["variant"].iloc[0]) if len(run_rows) else ""
    points = S.one_per_point(run_rows.loc[run_rows["quantity"].isin([quantity, "loss"])])
    diverged_at = S.divergence_step(run_rows, points)
    evals = points.loc[points["quantity"] == quantity].sort_values("step")["value"].to_numpy(dtype=float)
    train = points.loc[points["quantity"] == "loss"].sort_values("step")["value"].to_numpy(dtype=float)
    reference = train if len(train) else evals
    initial = float(reference[0]) if len(reference) else float("nan")
    finite = evals[np.isfinite(evals)]
    best = float(finite.min()) if len(finite) else float("nan")
    if diverged_at is not None:
        converged: bool | None = False
    elif not len(finite) or not np.isfinite(initial):
        converged = None
    else:
        converged = bool(best <= max_fraction * initial)
    return RunOutcome(run, variant, initial, best, diverged_at, converged)


def sweep_summary(df: pd.DataFrame, meta: pd.DataFrame, *, quantity: str = "val_loss",
                  max_fraction: float = MAX_FRACTION) -> pd.DataFrame:
    """One row per run with ``SWEEP_COLUMNS`` (the input of the depth-sweep claims and plot).

    Args:
        df: tidy table of every run of the sweep.
        meta: one row per run with columns ``run``, ``init``, ``depth`` (the table itself
            has no init column and depth is a training setting, so the caller states both).
        quantity: loss deciding convergence.
        max_fraction: see :func:`run_outcome`.

    Returns:
        Columns ``run, variant, init, depth, best_val_loss, converged`` (``converged`` is
        a nullable boolean: NA when undecided).
    """
    records = []
    for row in meta.itertuples(index=False):
        out = run_outcome(df, str(row.run), quantity=quantity, max_fraction=max_fraction)
        records.append({"run": out.run, "variant": out.variant, "init": str(row.init),
                        "depth": int(row.depth), "best_val_loss": out.best,
                        "converged": pd.NA if out.converged is None else out.converged})
    frame = pd.DataFrame.from_records(records, columns=list(SWEEP_COLUMNS))
    return frame.astype({"depth": "int64", "best_val_loss": "float64", "converged": "boolean"})


def _outcomes(df: pd.DataFrame, variants: Sequence[str], quantity: str, max_fraction: float
              ) -> tuple[dict[str, RunOutcome], list[str]]:
    """Outcome per variant (one run each) and the variants without a decided outcome."""
    out, undecided = {}, []
    for v in variants:
        names = sorted(S.single_run(df, variant=v)["run"].unique())
        oc = run_outcome(df, names[0], quantity=quantity, max_fraction=max_fraction) if names else None
        if oc is None or oc.converged is None:
            undecided.append(v)
        else:
            out[v] = oc
    return out, undecided


def _flags(outs: dict[str, RunOutcome]) -> dict[str, float]:
    vals = {}
    for v, oc in outs.items():
        vals[f"{v} converged"] = float(bool(oc.converged))
        vals[f"{v} best/initial"] = oc.best / oc.initial if oc.initial else float("nan")
    return vals


def takase_fig1_convergence(
    df: pd.DataFrame, *, fails: str = "post_ln", trains: Sequence[str] = ("pre_ln", "b2t"),
    quantity: str = "val_loss", max_fraction: float = MAX_FRACTION, preset: str = "",
) -> Verdict:
    """Takase (2022) Fig. 1/6/9: deep Post-LN fails to train; Pre-LN and B2T train.

    Rule (one run per variant, typically 18L-18L): ``fails`` did not converge and every
    variant in ``trains`` converged (:func:`run_outcome`).
    """
    figure = "Takase 2022 Fig. 1/6/9"
    claim = f"{fails} fails to train; {', '.join(trains)} train"
    metric = (f"not converged({fails}) and converged({', '.join(trains)}); converged = finite and "
              f"best {quantity} <= {max_fraction:g}·initial loss")
    outs, undecided = _outcomes(df, [fails, *trains], quantity, max_fraction)
    if undecided:
        return not_measured(figure, claim, metric, preset=preset, detail=f"no decided run for {undecided}")
    holds = not outs[fails].converged and all(outs[v].converged for v in trains)
    return verdict(figure, claim, metric, _flags(outs), holds, preset=preset, require_finite=False)


def nguyen_warmup_free(
    df: pd.DataFrame, *, fails: str = "post_ln", trains: Sequence[str] = ("pre_ln", "scalenorm"),
    quantity: str = "val_loss", max_fraction: float = MAX_FRACTION, preset: str = "",
) -> Verdict:
    """Nguyen & Salazar (2019): without warm-up, PreNorm/ScaleNorm train and PostNorm does not.

    Rule (runs trained without warm-up at a large learning rate): every variant in
    ``trains`` converged, and ``fails`` either did not converge or ends with a higher best
    loss than each of them.
    """
    figure = "Nguyen & Salazar 2019"
    claim = f"without warm-up {', '.join(trains)} train and {fails} does not (or ends higher)"
    metric = (f"converged({', '.join(trains)}) and (not converged({fails}) or "
              f"best({fails}) > max best(trains)); converged = finite and "
              f"best {quantity} <= {max_fraction:g}·initial loss")
    outs, undecided = _outcomes(df, [fails, *trains], quantity, max_fraction)
    if undecided:
        return not_measured(figure, claim, metric, preset=preset, detail=f"no decided run for {undecided}")
    worst_trained = max(outs[v].best for v in trains)
    base = outs[fails]
    holds = all(outs[v].converged for v in trains) and (not base.converged or base.best > worst_trained)
    values = {**_flags(outs), **{f"{v} best": outs[v].best for v in (fails, *trains)}}
    return verdict(figure, claim, metric, values, holds, preset=preset, require_finite=False)


def _runs(summary: pd.DataFrame, variant: str, init: str) -> pd.DataFrame:
    return summary.loc[(summary["variant"] == variant) & (summary["init"] == init)]


def _at_depth(summary: pd.DataFrame, variant: str, init: str, depth: int) -> bool | None:
    """True if every run of (variant, init) at ``depth`` converged, False if any failed."""
    sel = _runs(summary, variant, init)
    sel = sel.loc[sel["depth"] == depth]
    flags = sel["converged"].dropna()
    if flags.empty:
        return None
    return bool(flags.astype(bool).all())


def sweep_post_ln_fails_deep(
    summary: pd.DataFrame, *, variant: str = "post_ln", init: str = "xavier",
    trains: Sequence[str] = ("pre_ln", "b2t"), preset: str = "",
) -> Verdict:
    """Takase (2022) Fig. 8, Xu (2020) Table 1, Wang (2019) Fig. 3: deep Post-LN fails.

    Rule at D, the deepest depth of (variant, init) in the sweep summary: (variant, init)
    failed at D and every (t, init) for t in ``trains`` converged at D. Also reports the
    shallowest depth at which (variant, init) failed.
    """
    figure = "Takase 2022 Fig. 8 / Xu 2020 Table 1 / Wang 2019 Fig. 3"
    claim = f"{variant}+{init} fails at its deepest setting while {', '.join(trains)} converge there"
    metric = f"failed({variant}, D) and converged(t, D) for t in {list(trains)}, D = deepest {variant} depth"
    own = _runs(summary, variant, init)
    if own.empty:
        return not_measured(figure, claim, metric, preset=preset, detail=f"no {variant}+{init} runs")
    deepest = int(own["depth"].max())
    status = {v: _at_depth(summary, v, init, deepest) for v in (variant, *trains)}
    missing = [v for v, s in status.items() if s is None]
    if missing:
        return not_measured(figure, claim, metric, preset=preset,
                            detail=f"no decided run at depth {deepest} for {missing}")
    failed_depths = own.loc[own["converged"].eq(False).fillna(False).astype(bool), "depth"]
    first_failing = float(failed_depths.min()) if len(failed_depths) else float("nan")
    values = {"D": deepest, "first failing depth": first_failing,
              **{f"{v} converged": float(s) for v, s in status.items()}}
    holds = not status[variant] and all(status[t] for t in trains)
    return verdict(figure, claim, metric, values, holds, preset=preset, require_finite=False)


def sweep_lipschitz_rescues(
    summary: pd.DataFrame, *, variant: str = "post_ln", init: str = "lipschitz",
    baseline_init: str = "xavier", preset: str = "",
) -> Verdict:
    """Xu (2020) Table 3: Lipschitz-restricted init lets deep Post-LN converge.

    Rule at D, the deepest depth both (variant, baseline_init) and (variant, init) ran:
    the baseline failed and the ``init`` run converged. If the baseline converged there,
    nothing was rescued and the claim does not hold at this preset.
    """
    figure = "Xu 2020 Table 3 / Takase 2022 Fig. 8"
    claim = f"{init} init rescues {variant} where {baseline_init} fails"
    metric = (f"failed({variant}+{baseline_init}, D) and converged({variant}+{init}, D), "
              "D = deepest common depth")
    depths = [set(_runs(summary, variant, i)["depth"]) for i in (baseline_init, init)]
    common = depths[0] & depths[1]
    if not common:
        return not_measured(figure, claim, metric, preset=preset,
                            detail=f"no depth with both {baseline_init} and {init}")
    deepest = int(max(common))
    base = _at_depth(summary, variant, baseline_init, deepest)
    ours = _at_depth(summary, variant, init, deepest)
    if base is None or ours is None:
        return not_measured(figure, claim, metric, preset=preset, detail=f"undecided run at depth {deepest}")
    detail = "" if not base else f"{variant}+{baseline_init} converged at D: nothing to rescue"
    values = {"D": deepest, f"{baseline_init} converged": float(base), f"{init} converged": float(ours)}
    return verdict(figure, claim, metric, values, (not base) and ours, preset=preset, detail=detail)
