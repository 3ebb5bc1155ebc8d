"""Deciding a claim over seeds: the same rule on each seed's runs, then one verdict.

A run of seed k > 0 is named ``"<run> · seed k"`` (:func:`seed_run`); seed 0 keeps the plain
name. :func:`by_seed` splits a table into one table per seed with the plain names, so every
rule written for one run per variant applies to each seed unchanged; :func:`over_seeds`
combines the seeds' verdicts:

- values: the mean over seeds, with the *spread* = the largest deviation of a seed from the
  mean (``max_i |x_i - mean|``);
- a rule with a margin (the signed distance from its boundary, > 0 in the claim's
  direction): **holds** when ``mean(margin) > spread(margin)`` (so every seed is on the
  claim's side, and the mean clears the seeds' scatter), **does not hold** when
  ``mean(margin) < -spread(margin)``, else **inconclusive** (a margin inside the spread);
- a rule on outcomes (no margin): holds / does not hold when every seed says so, else
  inconclusive;
- fewer than :data:`MIN_SEEDS` seeds, or a seed whose verdict is inconclusive: inconclusive.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from gradscope.claims.quotes import quote_for
from gradscope.claims.verdict import Verdict

MIN_SEEDS = 3
_SEED = re.compile(r"^(?P<run>.*) · seed (?P<seed>\d+)$")


def seed_run(run: str, seed: int) -> str:
    """The run name of ``run`` at ``seed`` (seed 0: ``run`` itself)."""
    return run if seed == 0 else f"{run} · seed {seed}"


def split_run(name: str) -> tuple[str, int]:
    """``(run, seed)`` of a run name made by :func:`seed_run`."""
    match = _SEED.match(name)
    return (match["run"], int(match["seed"])) if match else (name, 0)


def by_seed(df: pd.DataFrame) -> dict[int, pd.DataFrame]:
    """One table per seed, its runs renamed to their plain names (seed order)."""
    if df.empty:
        return {}
    parts = df["run"].map(split_run)
    seeds = parts.map(lambda p: p[1])
    out = {}
    for seed in sorted(seeds.unique()):
        sel = df.loc[seeds == seed].copy()
        sel["run"] = parts[seeds == seed].map(lambda p: p[0]).astype(df["run"].dtype)
        out[int(seed)] = sel
    return out


def _spread(xs: Sequence[float]) -> tuple[float, float]:
    arr = np.asarray(xs, dtype=float)
    mean = float(arr.mean())
    return mean, float(np.abs(arr - mean).max()) if len(arr) > 1 else 0.0


def combine(verdicts: Sequence[Verdict], *, min_seeds: int = MIN_SEEDS) -> Verdict:
    """One verdict from the same rule's verdicts on several seeds (module docstring).

    Raises:
        ValueError: no verdicts.
    """
    if not verdicts:
        raise ValueError("combine: no verdicts")
    first, n = verdicts[0], len(verdicts)
    keys = [k for k in first.values if all(k in v.values for v in verdicts)]
    values, spread = {}, {}
    for k in keys:
        values[k], spread[k] = _spread([v.values[k] for v in verdicts])
    margins = [v.margin for v in verdicts]
    details = sorted({v.detail for v in verdicts if v.detail})
    margin = margin_spread = None
    if any(v.holds is None for v in verdicts):
        holds, why = None, f"{sum(v.holds is None for v in verdicts)} of {n} seeds inconclusive"
    elif all(m is not None and np.isfinite(m) for m in margins):
        margin, margin_spread = _spread(margins)
        holds = True if margin > margin_spread else False if margin < -margin_spread else None
        why = "" if holds is not None else "margin zero" if margin_spread == 0 else "margin inside the spread over seeds"
    else:
        flags = {bool(v.holds) for v in verdicts}
        holds, why = (flags.pop(), "") if len(flags) == 1 else (None, "the seeds disagree")
    if n < min_seeds:
        holds, why = None, f"{n} seed{'s' if n != 1 else ''}; a verdict needs >= {min_seeds}"
    detail = "; ".join([w for w in (why, *details) if w])
    return dataclasses.replace(first, values=values, spread=spread if n > 1 else {}, holds=holds, detail=detail,
                               margin=margin, margin_spread=margin_spread if n > 1 else None, seeds=n)


def over_seeds(rule: Callable[..., Verdict], df: pd.DataFrame, *, min_seeds: int = MIN_SEEDS,
               **kwargs: object) -> Verdict:
    """``rule(table_of_one_seed, **kwargs)`` on every seed of ``df``, combined by :func:`combine`."""
    tables = by_seed(df)
    if not tables:
        tables = {0: df}
    v = combine([rule(t, **kwargs) for t in tables.values()], min_seeds=min_seeds)
    return v if v.quote else dataclasses.replace(v, quote=quote_for(getattr(rule, "__name__", "")))


def with_quote(v: Verdict, quote: str, kind: str | None = None) -> Verdict:
    """``v`` with the paper's sentence it checks (and, if given, its kind)."""
    return dataclasses.replace(v, quote=quote, **({"kind": kind} if kind else {}))


def seed_counts(df: pd.DataFrame) -> Mapping[str, int]:
    """How many seeds each plain run name has in ``df``."""
    counts: dict[str, set[int]] = {}
    for name in df["run"].unique():
        run, seed = split_run(str(name))
        counts.setdefault(run, set()).add(seed)
    return {run: len(s) for run, s in counts.items()}
