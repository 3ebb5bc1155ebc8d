"""Convergence claims: Takase (2022) Fig. 1/6/8/9, Xu (2020) Tables 1/3, Wang (2019) Fig. 3,
Nguyen & Salazar (2019), on runs' outcomes anchored to their task (:mod:`gradscope.claims.outcome`).

Each rule decides one seed's runs (one run per variant, or per (variant, init, depth) in a
sweep summary); :func:`gradscope.claims.seeds.over_seeds` (or the sweep rules themselves, over
the summary's ``seed`` column) combines the seeds: a claim holds or does not hold only when
every one of >= 3 seeds says so. A *partial* run (left chance, did not learn) makes its seed
inconclusive, and so does a run that neither learned nor failed where the claim needs one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pandas as pd

from gradscope.claims.outcome import FAILED, LEARNED, PARTIAL, RULE, RunOutcome, run_outcome
from gradscope.claims.quotes import quote_for
from gradscope.claims.seeds import MIN_SEEDS, combine, split_run, with_quote
from gradscope.claims.verdict import Verdict, not_measured, verdict
from gradscope.table import SWEEP_COLUMNS
from gradscope.table import select as S
from gradscope.train.bounds import LossBounds

SUMMARY_COLUMNS = (*SWEEP_COLUMNS, "seed", "gap_closed", "accuracy", "outcome")


def sweep_summary(df: pd.DataFrame, meta: pd.DataFrame, bounds: LossBounds, *, quantity: str = "val_loss"
                  ) -> pd.DataFrame:
    """One row per run: ``SWEEP_COLUMNS`` then ``seed, gap_closed, accuracy, outcome``.

    Args:
        df: tidy table of every run of the sweep.
        meta: one row per run with columns ``run``, ``init``, ``depth`` (the table itself
            has no init column and depth is a training setting, so the caller states both).
        bounds: the task's chance and floor.
        quantity: loss deciding the outcome.

    Returns:
        ``converged`` is a nullable boolean: True learned, False failed, NA otherwise.
    """
    records = []
    for row in meta.itertuples(index=False):
        out = run_outcome(df, str(row.run), bounds, quantity=quantity)
        records.append({"run": out.run, "variant": out.variant, "init": str(row.init), "depth": int(row.depth),
                        "best_val_loss": out.best, "converged": pd.NA if out.converged is None else out.converged,
                        "seed": split_run(out.run)[1], "gap_closed": out.gap_closed, "accuracy": out.accuracy,
                        "outcome": out.status})
    frame = pd.DataFrame.from_records(records, columns=list(SUMMARY_COLUMNS))
    return frame.astype({"depth": "int64", "best_val_loss": "float64", "converged": "boolean", "seed": "int64",
                         "gap_closed": "float64", "accuracy": "float64"})


def _outcomes(df: pd.DataFrame, variants: Sequence[str], bounds: LossBounds, quantity: str
              ) -> tuple[dict[str, RunOutcome], list[str]]:
    """Outcome per variant (one run each) and the variants without a run."""
    out, missing = {}, []
    for v in variants:
        names = sorted(S.single_run(df, variant=v)["run"].unique())
        if names:
            out[v] = run_outcome(df, names[0], bounds, quantity=quantity)
        else:
            missing.append(v)
    return out, missing


def _values(outs: dict[str, RunOutcome]) -> dict[str, float]:
    vals = {}
    for v, oc in outs.items():
        vals[f"{v} gap closed"] = oc.gap_closed
        if oc.accuracy == oc.accuracy:  # (not logged by older tables: left out, not NaN)
            vals[f"{v} accuracy"] = oc.accuracy
    return vals


PARTIAL_WHY = "a partial run left chance but did not learn within its steps (budget)"


def _statuses(statuses: dict[str, str]) -> str:
    text = ", ".join(f"{v} {s}" for v, s in statuses.items())
    return text + (f"; {PARTIAL_WHY}" if PARTIAL in statuses.values() else "")


def _fails_and_trains(figure: str, claim: str, metric: str, df: pd.DataFrame, fails: str, trains: Sequence[str],
                      bounds: LossBounds, quantity: str, preset: str) -> Verdict:
    outs, missing = _outcomes(df, [fails, *trains], bounds, quantity)
    if missing:
        return not_measured(figure, claim, metric, preset=preset, detail=f"no run for {missing}")
    failed = outs[fails].status in FAILED
    learned = [outs[v].status == LEARNED for v in trains]
    contradicted = outs[fails].status == LEARNED or any(outs[v].status in FAILED for v in trains)
    holds = True if failed and all(learned) else False if contradicted else None
    v = verdict(figure, claim, metric, _values(outs), bool(holds), preset=preset,
                detail=_statuses({k: oc.status for k, oc in outs.items()}),
                require_finite=False)
    return v if holds is not None else dataclasses.replace(v, holds=None)


def takase_fig1_convergence(
    df: pd.DataFrame, bounds: LossBounds, *, fails: str = "post_ln", trains: Sequence[str] = ("pre_ln", "b2t"),
    quantity: str = "val_loss", preset: str = "",
) -> Verdict:
    """Takase (2022) Fig. 1/6/9: deep Post-LN fails to train; Pre-LN and B2T train (one seed).

    Rule: ``fails`` failed (diverged or stuck at chance) and every variant in ``trains``
    learned (:mod:`gradscope.claims.outcome`); does not hold when ``fails`` learned or one of
    ``trains`` failed; inconclusive otherwise (a partial run).
    """
    figure = "Takase 2022 Fig. 1/6/9"
    claim = f"{fails} fails to train; {', '.join(trains)} train"
    metric = f"failed({fails}) and learned({', '.join(trains)}); {RULE}"
    return _fails_and_trains(figure, claim, metric, df, fails, trains, bounds, quantity, preset)


def nguyen_warmup_free(
    df: pd.DataFrame, bounds: LossBounds, *, fails: str = "post_ln", trains: Sequence[str] = ("pre_ln", "scalenorm"),
    quantity: str = "val_loss", preset: str = "",
) -> Verdict:
    """Nguyen & Salazar (2019): without warm-up, PreNorm/ScaleNorm train and PostNorm does not (one seed).

    Rule (runs trained without warm-up at a large learning rate): as
    :func:`takase_fig1_convergence`: ``fails`` failed and every variant of ``trains`` learned.
    """
    figure = "Nguyen & Salazar 2019 §1, §4.1"
    claim = f"without warm-up {', '.join(trains)} train and {fails} does not"
    metric = f"failed({fails}) and learned({', '.join(trains)}); {RULE}"
    return _fails_and_trains(figure, claim, metric, df, fails, trains, bounds, quantity, preset)


def _at_depth(summary: pd.DataFrame, variant: str, init: str, depth: int, seed: int) -> str | None:
    """The outcome of (variant, init) at ``depth`` and ``seed``, or None without such a run."""
    sel = summary.loc[(summary["variant"] == variant) & (summary["init"] == init) & (summary["depth"] == depth)
                      & (summary["seed"] == seed)]
    return None if sel.empty else str(sel["outcome"].iloc[0])


def _seeds(summary: pd.DataFrame) -> list[int]:
    return sorted(int(s) for s in summary["seed"].unique())


def sweep_post_ln_fails_deep(
    summary: pd.DataFrame, *, variant: str = "post_ln", init: str = "xavier",
    trains: Sequence[str] = ("pre_ln", "b2t"), preset: str = "", min_seeds: int = MIN_SEEDS,
) -> Verdict:
    """Takase (2022) Fig. 8, Xu (2020) Table 1, Wang (2019) Fig. 3: deep Post-LN fails.

    Rule per seed at D, the deepest depth of (variant, init) in the summary
    (:func:`sweep_summary`): (variant, init) failed and every (t, init) for t in ``trains``
    learned; over seeds as :func:`gradscope.claims.seeds.combine`.
    """
    figure = "Takase 2022 Fig. 8 / Xu 2020 Table 1 / Wang 2019 Fig. 3"
    claim = f"{variant}+{init} fails at its deepest setting while {', '.join(trains)} train there"
    metric = f"failed({variant}, D) and learned(t, D) for t in {list(trains)}, D = deepest {variant} depth; {RULE}"
    own = summary.loc[(summary["variant"] == variant) & (summary["init"] == init)]
    if own.empty:
        return not_measured(figure, claim, metric, preset=preset, detail=f"no {variant}+{init} runs")
    deepest = int(own["depth"].max())
    per_seed = []
    for seed in _seeds(own):
        status = {v: _at_depth(summary, v, init, deepest, seed) for v in (variant, *trains)}
        missing = [v for v, s in status.items() if s is None]
        if missing:
            per_seed.append(not_measured(figure, claim, metric, preset=preset, detail=f"no run at D for {missing}"))
            continue
        sub = summary.loc[(summary["depth"] == deepest) & (summary["init"] == init) & (summary["seed"] == seed)]
        values = {"D": deepest, **{f"{v} gap closed": float(sub.loc[sub["variant"] == v, "gap_closed"].iloc[0])
                                   for v in (variant, *trains)}}
        failed, learned = status[variant] in FAILED, [status[t] == LEARNED for t in trains]
        contradicted = status[variant] == LEARNED or any(status[t] in FAILED for t in trains)
        holds = True if failed and all(learned) else False if contradicted else None
        v = verdict(figure, claim, metric, values, bool(holds), preset=preset, require_finite=False,
                    detail=_statuses(status))
        per_seed.append(v if holds is not None else dataclasses.replace(v, holds=None))
    return with_quote(combine(per_seed, min_seeds=min_seeds), quote_for("sweep_post_ln_fails_deep"))


def sweep_lipschitz_rescues(
    summary: pd.DataFrame, *, variant: str = "post_ln", init: str = "lipschitz",
    baseline_init: str = "xavier", preset: str = "", min_seeds: int = MIN_SEEDS,
) -> Verdict:
    """Xu (2020) Table 3: Lipschitz-restricted init lets deep Post-LN converge.

    Rule per seed at D, the deepest depth both (variant, baseline_init) and (variant, init)
    ran: the baseline failed and the ``init`` run learned. Does not hold when the ``init``
    run failed or the baseline learned (nothing to rescue); inconclusive otherwise.
    """
    figure = "Xu 2020 Table 3 / Takase 2022 Fig. 8"
    claim = f"{init} init rescues {variant} where {baseline_init} fails"
    metric = f"failed({variant}+{baseline_init}, D) and learned({variant}+{init}, D), D = deepest common depth; {RULE}"
    runs = [summary.loc[(summary["variant"] == variant) & (summary["init"] == i)] for i in (baseline_init, init)]
    common = set(runs[0]["depth"]) & set(runs[1]["depth"])
    if not common:
        return not_measured(figure, claim, metric, preset=preset,
                            detail=f"no depth with both {baseline_init} and {init}")
    deepest = int(max(common))
    per_seed = []
    for seed in _seeds(runs[0]):
        base, ours = (_at_depth(summary, variant, i, deepest, seed) for i in (baseline_init, init))
        if base is None or ours is None:
            per_seed.append(not_measured(figure, claim, metric, preset=preset, detail=f"no run at D for seed {seed}"))
            continue
        gaps = {i: float(r.loc[(r["depth"] == deepest) & (r["seed"] == seed), "gap_closed"].iloc[0])
                for i, r in zip((baseline_init, init), runs)}
        values = {"D": deepest, **{f"{i} gap closed": g for i, g in gaps.items()}}
        holds = True if base in FAILED and ours == LEARNED else False if ours in FAILED or base == LEARNED else None
        v = verdict(figure, claim, metric, values, bool(holds), preset=preset, require_finite=False,
                    detail=_statuses({baseline_init: base, init: ours}))
        per_seed.append(v if holds is not None else dataclasses.replace(v, holds=None))
    return with_quote(combine(per_seed, min_seeds=min_seeds), quote_for("sweep_lipschitz_rescues"))
