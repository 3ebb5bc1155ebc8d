"""Claims about matrices: Takase (2022) Fig. 5 cosine similarities, Wang (2019) Fig. 5 DLCL W.

Matrices are indexed 0..L (row i / r, column j / k), ``y_0`` the embedding output.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from gradscope.claims.verdict import Verdict, not_measured, verdict
from gradscope.table import select as S
from gradscope.table.select import StepSpec

FIG5 = "Takase 2022 Fig. 5"
WANG5 = "Wang 2019 Fig. 5"


def _matrix(df: pd.DataFrame, quantity: str, variant: str | None, run: str | None, stack: str,
            step: StepSpec) -> np.ndarray:
    return S.one_matrix(df, quantity, run=run, variant=variant, stack=stack, step=step)[0]


def lower_left_mean(s: np.ndarray) -> float:
    """Mean of S[i, j] over rows i > L/2 and columns j < L/2 (deep outputs vs shallow ones)."""
    top = len(s) - 1
    i, j = np.arange(len(s))[:, None], np.arange(len(s))[None, :]
    block = s[(i > top / 2) & (j < top / 2)]
    block = block[np.isfinite(block)]
    return float(block.mean()) if block.size else float("nan")


def _lower_left(df: pd.DataFrame, variants: dict[str, str], stack: str, step: StepSpec
                ) -> tuple[dict[str, float], list[str]]:
    """Lower-left means by role (``post``...), and the variants that had no usable matrix."""
    out, missing = {}, []
    for role, variant in variants.items():
        mat = _matrix(df, "cosine", variant, None, stack, step)
        value = lower_left_mean(mat) if len(mat) >= 3 else float("nan")
        if math.isnan(value):
            missing.append(variant)
        else:
            out[role] = value
    return out, missing


def takase_fig5_pre_ln_higher(
    df: pd.DataFrame, *, pre: str = "pre_ln", post: str = "post_ln", stack: str = "decoder",
    step: StepSpec = "last", preset: str = "",
) -> Verdict:
    """Takase (2022) Fig. 5: Pre-LN's lower-left similarities are higher than Post-LN's.

    Rule: ``LL(pre_ln) > LL(post_ln)``, LL = :func:`lower_left_mean` of the cosine matrix
    at ``step`` (default the trained model).
    """
    claim = f"{pre}'s lower-left {stack} cosine similarities exceed {post}'s"
    metric = f"LL({pre}) > LL({post}), LL = mean S[i,j] over i > L/2, j < L/2, step {step}"
    ll, missing = _lower_left(df, {"pre": pre, "post": post}, stack, step)
    if missing:
        return not_measured(FIG5, claim, metric, preset=preset,
                            detail=f"no cosine matrix (L >= 2) for {missing}")
    return verdict(FIG5, claim, metric, {f"LL {pre}": ll["pre"], f"LL {post}": ll["post"]},
                   ll["pre"] > ll["post"], preset=preset, margin=ll["pre"] - ll["post"])


def takase_fig5_b2t_keeps_post_ln(
    df: pd.DataFrame, *, b2t: str = "b2t", pre: str = "pre_ln", post: str = "post_ln",
    stack: str = "decoder", step: StepSpec = "last", preset: str = "",
) -> Verdict:
    """Takase (2022) Fig. 5c: B2T keeps Post-LN's similarity pattern.

    Rule: ``|LL(b2t) - LL(post_ln)| < |LL(pre_ln) - LL(post_ln)|``: B2T's lower-left block
    is nearer Post-LN's than Pre-LN's is.
    """
    claim = f"{b2t}'s {stack} cosine pattern stays close to {post}'s"
    metric = f"|LL({b2t}) - LL({post})| < |LL({pre}) - LL({post})|, step {step}"
    ll, missing = _lower_left(df, {"b2t": b2t, "pre": pre, "post": post}, stack, step)
    if missing:
        return not_measured(FIG5, claim, metric, preset=preset,
                            detail=f"no cosine matrix (L >= 2) for {missing}")
    d_b2t, d_pre = abs(ll["b2t"] - ll["post"]), abs(ll["pre"] - ll["post"])
    return verdict(FIG5, claim, metric, {f"|{b2t}-{post}|": d_b2t, f"|{pre}-{post}|": d_pre},
                   d_b2t < d_pre, preset=preset, margin=d_pre - d_b2t)


def row_density(w: np.ndarray, abs_threshold: float, rel_threshold: float) -> np.ndarray:
    """Share of each row's lower-triangle cells (r + 1 of them) left after the Fig. 5 mask."""
    kept = np.tril(~S.dlcl_mask(w, abs_threshold, rel_threshold))
    return kept.sum(axis=1) / np.arange(1, len(w) + 1)


def wang_fig5_dlcl_dense_early(
    df: pd.DataFrame, *, variant: str = "dlcl_pre", run: str | None = None, stack: str = "encoder",
    step: StepSpec = "last", abs_threshold: float = 0.1, rel_threshold: float = 0.05, preset: str = "",
) -> Verdict:
    """Wang (2019) Fig. 5: after masking, early rows of W are dense and later rows sparse.

    Rule: with density(r) = :func:`row_density` (mask ``|w| < abs_threshold`` or
    ``< rel_threshold`` × row max) over rows r = 1..L (row 0 has a single cell), split at
    m = (1 + L) / 2: ``mean density(r <= m) > mean density(r > m)``. Needs L >= 2.
    Note: the paper's absolute threshold alone masks an ``avg``-initialised row r once
    1/(r+1) < 0.1, so compare with the step-0 verdict before reading a trained one.
    """
    claim = f"{run or variant} {stack} DLCL weights: early rows denser than later rows"
    metric = (f"mean density(r <= (1+L)/2) > mean density(r > (1+L)/2), r >= 1, masked |w| < "
              f"{abs_threshold:g} or < {rel_threshold:.0%} of row max, step {step}")
    w = _matrix(df, "dlcl_weight", variant, run, stack, step)
    if len(w) < 3:
        return not_measured(WANG5, claim, metric, preset=preset, detail=f"W has {len(w)} row(s), need 3")
    density, r = row_density(w, abs_threshold, rel_threshold), np.arange(len(w))
    mid = (1 + (len(w) - 1)) / 2
    early, late = density[(r >= 1) & (r <= mid)].mean(), density[r > mid].mean()
    return verdict(WANG5, claim, metric, {"early density": early, "late density": late},
                   early > late, preset=preset, margin=early - late)


def wang_fig5_dlcl_near_diagonal(
    df: pd.DataFrame, *, variant: str = "dlcl_pre", run: str | None = None, stack: str = "encoder",
    step: StepSpec = "last", band_fraction: float = 0.25, min_ratio: float = 1.25, preset: str = "",
) -> Verdict:
    """Wang (2019) Fig. 5: W's mass sits near the diagonal (recent layers weigh most).

    Rule: band width b = max(1, ceil(band_fraction · L)) diagonals (cells with r - k < b).
    Over rows with more than b cells, f(r) = Σ_band |W[r, k]| / Σ_k |W[r, k]| and the
    uniform expectation u(r) = b / (r + 1); holds when ``mean f > min_ratio · mean u``.
    An ``avg``-initialised W gives f = u exactly; ``min_ratio`` (default 1.25, i.e. "at
    least 25% more mass than uniform") keeps small drifts from that init from counting as
    concentration. No masking.
    """
    claim = f"{run or variant} {stack} DLCL weight mass concentrates near the diagonal"
    metric = (f"mean_r Σ_band|W|/Σ|W| > {min_ratio:g} · mean_r b/(r+1), "
              f"b = max(1, ceil({band_fraction:g}·L)), step {step}")
    w = _matrix(df, "dlcl_weight", variant, run, stack, step)
    top = len(w) - 1
    band = max(1, math.ceil(band_fraction * top))
    rows = [r for r in range(len(w)) if r + 1 > band]
    if top < 2 or not rows:
        return not_measured(WANG5, claim, metric, preset=preset, detail=f"W has {len(w)} row(s), need 3")
    a = np.nan_to_num(np.abs(np.tril(w)))
    f = [a[r, r - band + 1 : r + 1].sum() / a[r, : r + 1].sum() for r in rows]
    u = [band / (r + 1) for r in rows]
    values = {"band mass": float(np.mean(f)), "uniform": float(np.mean(u)), "band width": band}
    holds = values["band mass"] > min_ratio * values["uniform"]
    return verdict(WANG5, claim, metric, values, holds, preset=preset,
                   margin=values["band mass"] - min_ratio * values["uniform"])
