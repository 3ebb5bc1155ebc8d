"""The outcome of a training run, anchored to its task: one rule for every training claim.

The task states its chance loss (best input-independent predictor) and floor (best
predictor) under the loss it trains with (:func:`gradscope.train.loss_bounds`). A run's

- **gap closed** = ``(chance - best val loss) / (chance - floor)``: 0 at chance, 1 at the floor;
- **accuracy** = its best validation token accuracy (``val_accuracy``; NaN when not logged).

Its outcome, with thresholds fixed before any run:

- **diverged**: a non-finite loss, or a ``nonfinite`` row of the recorder (failed);
- **stuck at chance**: gap closed < :data:`CHANCE_GAP` (0.1) (failed);
- **learned**: gap closed >= :data:`LEARNED_GAP` (0.5) and, where logged, accuracy >=
  :data:`LEARNED_ACCURACY` (0.5: most target tokens right);
- **partial**: in between: it left chance but did not learn within the run (neither);
- **undecided**: no finite validation loss and no divergence.

``converged`` is True for *learned*, False for *failed* (diverged or stuck at chance), None
otherwise; a claim that needs a run to train or to fail is inconclusive on a *partial* run.
Convergence, warm-up-free training, the depth sweep and the scan's agreement all use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from gradscope.table import select as S
from gradscope.train.bounds import LossBounds

LEARNED_GAP = 0.5
CHANCE_GAP = 0.1
LEARNED_ACCURACY = 0.5
LEARNED, PARTIAL, STUCK, DIVERGED, UNDECIDED = "learned", "partial", "stuck at chance", "diverged", "undecided"
FAILED = (STUCK, DIVERGED)
RULE = (f"learned = gap closed >= {LEARNED_GAP:g} and token accuracy >= {LEARNED_ACCURACY:g}; failed = diverged or "
        f"stuck at chance (gap closed < {CHANCE_GAP:g}); gap closed = (chance - best val loss) / (chance - floor)")


@dataclass(frozen=True)
class RunOutcome:
    """Outcome of one run (module docstring).

    Attributes:
        run: run name.
        variant: the run's variant.
        initial: the untrained model's loss (first training loss), NaN if none; for reference only.
        best: lowest finite validation loss (nats), NaN if none.
        gap_closed: ``(chance - best) / (chance - floor)``, NaN without a finite evaluation.
        accuracy: best validation token accuracy, NaN when not logged.
        diverged_at: first step with a non-finite value, or None.
        status: ``learned``, ``partial``, ``stuck at chance``, ``diverged`` or ``undecided``.
    """

    run: str
    variant: str
    initial: float
    best: float
    gap_closed: float
    accuracy: float
    diverged_at: int | None
    status: str

    @property
    def converged(self) -> bool | None:
        """True when learned, False when failed (diverged or stuck at chance), else None."""
        return True if self.status == LEARNED else False if self.status in FAILED else None


def classify(gap_closed: float, accuracy: float, diverged: bool) -> str:
    """The outcome of a run from its gap closed, accuracy (NaN: not logged) and divergence."""
    if diverged:
        return DIVERGED
    if not math.isfinite(gap_closed):
        return UNDECIDED
    if gap_closed < CHANCE_GAP:
        return STUCK
    if gap_closed >= LEARNED_GAP and (math.isnan(accuracy) or accuracy >= LEARNED_ACCURACY):
        return LEARNED
    return PARTIAL


def run_outcome(df: pd.DataFrame, run: str, bounds: LossBounds, *, quantity: str = "val_loss") -> RunOutcome:
    """The outcome of ``run`` (module docstring) against its task's ``bounds``.

    Args:
        df: tidy table holding the run's ``quantity``, ``loss`` and (if logged) ``val_accuracy`` rows.
        run: run name.
        bounds: the task's chance and floor under the loss the run trained with.
        quantity: the loss whose minimum is "best", ``val_loss`` (default) or ``loss``.
    """
    run_rows = S.rows(df, run=run)
    variant = str(run_rows["variant"].iloc[0]) if len(run_rows) else ""
    points = S.one_per_point(run_rows.loc[run_rows["quantity"].isin([quantity, "loss", "val_accuracy"])])
    diverged_at = S.divergence_step(run_rows, points.loc[points["quantity"] != "val_accuracy"])
    evals = points.loc[points["quantity"] == quantity].sort_values("step")["value"].to_numpy(dtype=float)
    train = points.loc[points["quantity"] == "loss"].sort_values("step")["value"].to_numpy(dtype=float)
    acc = points.loc[points["quantity"] == "val_accuracy", "value"].to_numpy(dtype=float)
    acc = acc[np.isfinite(acc)]
    finite = evals[np.isfinite(evals)]
    best = float(finite.min()) if len(finite) else float("nan")
    gap = bounds.gap_closed(best)
    accuracy = float(acc.max()) if len(acc) else float("nan")
    status = classify(gap, accuracy, diverged_at is not None)
    return RunOutcome(run, variant, float(train[0]) if len(train) else float("nan"), best, gap, accuracy,
                      diverged_at, status)
