"""Claims of the learning-rate sensitivity study (Wortsman et al. 2023, "Small-scale proxies
for large-scale Transformer training instabilities"), decided on a per-run summary.

The rules are fixed here before any run, on one seed's sweep (:func:`lr_summary`); the
analysis combines seeds with ``gradscope.claims.seeds.combine``:

- a run's **final loss** ℓ(η) is the mean of the last 10 % of its logged training losses
  (+inf if it diverged); ℓ₀ its first (untrained) loss;
- a setting's **LR sensitivity** is Wortsman et al. (2023) §2.2's
  ``E_η[min(ℓ(η), ℓ₀) − ℓ*]``, the mean over the swept (log-spaced) rates, with ℓ* the
  setting's lowest final loss over them: how much loss a wrong learning rate costs;
- a run's **logit growth** is the largest attention logit over its recorded steps (the max
  over layers of ``attn_logit_max``) divided by the one at step 0, before training;
- a run is **stable** (reported only) when it stayed finite and ended within
  ``LEARNED`` × its first loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import pandas as pd

from gradscope.claims.verdict import Verdict, not_measured, verdict

LEARNED = 0.95  # final loss at most this share of the first: the run learned
GROWTH = 10.0  # logits_grow_before_divergence's bound (no longer used by the analysis: not in the paper)
LOG_Z_NEAR_ZERO = 1.0  # |log Z| within 1 nat of 0
Z_ACTS = 0.5  # z-loss acts when it moved the final |log Z| by this many nats from the plain run's
HIGH_LRS = 2  # the logit comparison's rates: the sweep's highest two ("high learning rates")
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


def lr_sensitivity(runs: pd.DataFrame) -> float:
    """Wortsman 2023 §2.2: ``mean over the runs' rates of min(ℓ(η), ℓ₀) − ℓ*`` (nats), ℓ* the
    lowest final loss of ``runs`` (one setting's rows of :func:`lr_summary`); NaN if empty."""
    if runs.empty:
        return float("nan")
    capped = np.minimum(runs.final_loss.to_numpy(dtype=float), runs.first_loss.to_numpy(dtype=float))
    return float(np.mean(capped - np.nanmin(runs.final_loss.replace(np.inf, np.nan).to_numpy(dtype=float))))


def logits_grow_before_divergence(summary: pd.DataFrame, *, preset: str = "") -> Verdict:
    """Every unstable run without qk_norm or z-loss: logit growth > ``GROWTH``× (kept for the
    API; the analysis uses :func:`qk_norm_bounds_logits`, which has no such bound)."""
    claim = f"without qk_norm, attention logits grow > {GROWTH:g}x before the loss diverges at high lr"
    metric = f"every unstable pre_ln run (no qk_norm, no z-loss): peak attn_logit_max / at init > {GROWTH:g}"
    bad = _plain(summary, False)
    bad = bad[~bad.stable]
    if bad.empty:
        return not_measured(FIGURE, claim, metric, preset=preset, detail="no run without qk_norm became unstable")
    values = {f"growth at lr {r.lr:g}": r.logit_growth for r in bad.itertuples()}
    return verdict(FIGURE, claim, metric, values, bool((bad.logit_growth > GROWTH).all()), preset=preset,
                   require_finite=False)


def qk_norm_lowers_lr_sensitivity(summary: pd.DataFrame, *, preset: str = "") -> Verdict:
    """Wortsman 2023 §3.1.1: qk_norm lowers the LR sensitivity (one seed).

    Rule: ``S(pre_ln+qk_norm) < S(pre_ln)``, S = :func:`lr_sensitivity` over the same rates.
    Margin ``S(pre_ln) − S(pre_ln+qk_norm)`` (nats).
    """
    claim = "qk_norm lowers the LR sensitivity"
    metric = "E_lr[min(l(lr), l0) - l*] of pre_ln+qk_norm < that of pre_ln (Wortsman §2.2), same lrs"
    qk, plain = _plain(summary, True), _plain(summary, False)
    if qk.empty or plain.empty:
        return not_measured(FIGURE, claim, metric, preset=preset, detail="a setting has no run")
    s_qk, s_plain = lr_sensitivity(qk), lr_sensitivity(plain)
    return verdict(FIGURE, claim, metric, {"LR sensitivity qk_norm": s_qk, "LR sensitivity plain": s_plain},
                   s_qk < s_plain, preset=preset, margin=s_plain - s_qk)


def qk_norm_bounds_logits(summary: pd.DataFrame, *, preset: str = "") -> Verdict:
    """Wortsman 2023 §3.1.1: at high learning rates the attention logits of pre_ln grow, and
    qk_norm keeps them from growing (one seed).

    Rule: at each of the sweep's ``HIGH_LRS`` highest rates, logit growth(pre_ln) >
    growth(pre_ln+qk_norm). Margin: the smallest ``log(growth(plain) / growth(qk_norm))``.
    """
    claim = "at high lr, attention logits grow without qk_norm and qk_norm keeps them down"
    metric = f"growth(pre_ln) > growth(pre_ln+qk_norm) at the {HIGH_LRS} highest lrs; growth = peak / at-init max logit"
    qk, plain = _plain(summary, True).set_index("lr"), _plain(summary, False).set_index("lr")
    lrs = sorted(set(qk.index) & set(plain.index))[-HIGH_LRS:]
    if not lrs:
        return not_measured(FIGURE, claim, metric, preset=preset, detail="no lr with both settings")
    values, margins = {}, []
    for lr in lrs:
        a, b = float(plain.at[lr, "logit_growth"]), float(qk.at[lr, "logit_growth"])
        values[f"growth plain, lr {lr:g}"], values[f"growth qk_norm, lr {lr:g}"] = a, b
        margins.append(float(np.log(a / b)) if a > 0 and b > 0 else float("nan"))
    margin = min(margins)
    return verdict(FIGURE, claim, metric, values, bool(margin > 0), preset=preset, margin=margin)


def z_loss_keeps_log_z_near_zero(summary: pd.DataFrame, *, preset: str = "") -> Verdict:
    """Wortsman 2023 §3.1.2: z-loss pulls log Z toward 0, which mitigates output logit
    divergence at high learning rates: it lowers the LR sensitivity (one seed).

    Rule, where z-loss acts: first, at the rates where both runs stayed finite, the mean
    ``|log Z_final(plain)| − |log Z_final(z-loss)|`` must reach ``Z_ACTS`` nats; otherwise
    z-loss did not act at this coefficient and length, and the claim is inconclusive. Where
    it acts: ``S(pre_ln+z_loss) < S(pre_ln)`` (:func:`lr_sensitivity`), margin their difference.
    """
    claim = "z-loss pulls log Z toward 0 and lowers the LR sensitivity"
    metric = (f"mean over finite lrs of |log Z(plain)| - |log Z(z-loss)| >= {Z_ACTS:g} (it acts); then "
              "E_lr[min(l(lr), l0) - l*] of pre_ln+z_loss < that of pre_ln")
    plain = _plain(summary, False).set_index("lr")
    z = summary[(~summary.qk_norm) & (summary.z_loss > 0)].set_index("lr")
    both = [lr for lr in z.index if lr in plain.index and not z.at[lr, "diverged"] and not plain.at[lr, "diverged"]]
    if not both:
        return not_measured(FIGURE, claim, metric, preset=preset, detail="no lr where both runs stayed finite")
    moved = float(np.mean([abs(plain.at[lr, "log_z_last"]) - abs(z.at[lr, "log_z_last"]) for lr in both]))
    s_z, s_plain = lr_sensitivity(z.reset_index()), lr_sensitivity(plain.reset_index())
    values = {"|log Z| moved": moved, "LR sensitivity z-loss": s_z, "LR sensitivity plain": s_plain}
    if not moved >= Z_ACTS:
        coef = float(z.z_loss.iloc[0])
        return Verdict(FIGURE, claim, metric, values, None, preset,
                       f"z-loss {coef:g} did not act in this run length (|log Z| moved {moved:.2g} nats < {Z_ACTS:g}): "
                       "budget, not a verdict on the paper")
    return verdict(FIGURE, claim, metric, values, s_z < s_plain, preset=preset, margin=s_plain - s_z)
