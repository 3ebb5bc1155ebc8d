"""Claims of the learning-rate sensitivity study (Wortsman et al. 2023, "Small-scale proxies
for large-scale Transformer training instabilities"), decided on a per-run summary.

The rules are fixed here before any run:

- a run is **stable** when its loss stayed finite and its final loss (mean of the last 10 %
  of logged training losses) is at most ``LEARNED`` × its first loss;
- a run's **logit growth** is the largest attention logit over its recorded steps (the max
  over layers of ``attn_logit_max``) divided by the one at step 0, before training.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import pandas as pd

from gradscope.claims.verdict import Verdict, not_measured, verdict

LEARNED = 0.95  # final loss at most this share of the first: the run learned
GROWTH = 10.0  # Wortsman 2023 §3.1: attention logits grow by orders of magnitude before divergence
LOG_Z_NEAR_ZERO = 1.0  # |log Z| within 1 nat of 0
FIGURE = "Wortsman 2023 §3.1–3.2"

SUMMARY_COLUMNS = ("run", "setting", "qk_norm", "z_loss", "lr", "first_loss", "final_loss", "diverged", "stable",
                   "logit_init", "logit_peak", "logit_growth", "log_z_last")


def lr_summary(df: pd.DataFrame, runs: Mapping[str, tuple[str, bool, float, float]]) -> pd.DataFrame:
    """One row per run of an LR sweep (:data:`SUMMARY_COLUMNS`).

    Args:
        df: the sweep's tidy table (``loss``, ``attn_logit_max``, ``output_logit_log_z`` rows).
        runs: run name -> (setting label, qk_norm, z-loss coefficient, learning rate).
    """
    rows = []
    for run, (setting, qk_norm, z, lr) in runs.items():
        d = df[df.run == run]
        loss = d[(d.quantity == "loss") & (d.micro_step == -1)].sort_values("step").value.to_numpy()
        diverged = bool(len(loss) == 0 or not np.isfinite(loss).all())
        tail = loss[-max(1, len(loss) // 10):] if len(loss) else loss
        final = math.inf if diverged else float(tail.mean())
        first = float(loss[0]) if len(loss) else math.nan
        logits = d[(d.quantity == "attn_logit_max") & d.layer_j.isna()].groupby("step").value.max().sort_index()
        init = float(logits.iloc[0]) if len(logits) and logits.index[0] == 0 else math.nan
        peak = float(np.nanmax(logits.to_numpy())) if len(logits) else math.nan
        log_z = d[d.quantity == "output_logit_log_z"].sort_values("step").value
        log_z = log_z[np.isfinite(log_z)]
        rows.append(dict(run=run, setting=setting, qk_norm=qk_norm, z_loss=z, lr=lr, first_loss=first, final_loss=final,
                         diverged=diverged, stable=bool(not diverged and final <= LEARNED * first),
                         logit_init=init, logit_peak=peak, logit_growth=peak / init if init > 0 else math.nan,
                         log_z_last=float(log_z.iloc[-1]) if len(log_z) else math.nan))
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))


def _plain(summary: pd.DataFrame, qk_norm: bool) -> pd.DataFrame:
    return summary[(summary.qk_norm == qk_norm) & (summary.z_loss == 0)]


def logits_grow_before_divergence(summary: pd.DataFrame, *, preset: str = "") -> Verdict:
    """Claim 1: without qk_norm, attention logits grow by more than ``GROWTH``× before the
    loss diverges at a high learning rate (every unstable run without qk_norm or z-loss)."""
    claim = f"without qk_norm, attention logits grow > {GROWTH:g}x before the loss diverges at high lr"
    metric = f"every unstable pre_ln run (no qk_norm, no z-loss): peak attn_logit_max / at init > {GROWTH:g}"
    bad = _plain(summary, False)
    bad = bad[~bad.stable]
    if bad.empty:
        return not_measured(FIGURE, claim, metric, preset=preset, detail="no run without qk_norm became unstable")
    values = {f"growth at lr {r.lr:g}": r.logit_growth for r in bad.itertuples()}
    return verdict(FIGURE, claim, metric, values, bool((bad.logit_growth > GROWTH).all()), preset=preset,
                   require_finite=False)


def qk_norm_bounds_logits(summary: pd.DataFrame, *, preset: str = "") -> Verdict:
    """Claim 2: qk_norm keeps the attention logits bounded (growth ≤ ``GROWTH``× at every
    rate) and widens the range of stable learning rates (more stable rates than without)."""
    claim = "qk_norm keeps attention logits bounded and widens the range of stable learning rates"
    metric = (f"max growth(qk_norm runs) <= {GROWTH:g} and #stable lrs(qk_norm) > #stable lrs(no qk_norm); "
              f"stable = finite and final loss <= {LEARNED:g}·first loss")
    qk, plain = _plain(summary, True), _plain(summary, False)
    if qk.empty or plain.empty:
        return not_measured(FIGURE, claim, metric, preset=preset, detail="a setting has no run")
    growth = float(qk.logit_growth.max())
    values = {"max growth with qk_norm": growth, "stable lrs with qk_norm": float(qk.stable.sum()),
              "stable lrs without": float(plain.stable.sum())}
    holds = bool(growth <= GROWTH and qk.stable.sum() > plain.stable.sum())
    return verdict(FIGURE, claim, metric, values, holds, preset=preset, require_finite=False)


def z_loss_keeps_log_z_near_zero(summary: pd.DataFrame, *, preset: str = "") -> Verdict:
    """Claim 3: z-loss keeps log Z near 0: at every rate where both runs are stable, the
    z-loss run's final |log Z| is within ``LOG_Z_NEAR_ZERO`` nat of 0 and below the plain run's."""
    claim = "z-loss keeps the output logits' log Z near 0"
    metric = (f"at every lr where pre_ln and pre_ln+z_loss are stable: |log Z_final(z-loss)| <= {LOG_Z_NEAR_ZERO:g} "
              "and < |log Z_final(plain)|")
    plain = _plain(summary, False).set_index("lr")
    z = summary[(~summary.qk_norm) & (summary.z_loss > 0)].set_index("lr")
    both = [lr for lr in z.index if lr in plain.index and z.at[lr, "stable"] and plain.at[lr, "stable"]]
    if not both:
        return not_measured(FIGURE, claim, metric, preset=preset, detail="no lr where both runs are stable")
    values = {}
    holds = True
    for lr in both:
        a, b = abs(z.at[lr, "log_z_last"]), abs(plain.at[lr, "log_z_last"])
        values[f"|log Z| z-loss, lr {lr:g}"], values[f"|log Z| plain, lr {lr:g}"] = a, b
        holds &= bool(a <= LOG_Z_NEAR_ZERO and a < b)
    return verdict(FIGURE, claim, metric, values, holds, preset=preset)
