"""The claims of ``analyses.spike_replay`` (issue 26), fixed before any run.

- :func:`replay_flags_planted_step`: the step whose loss was multiplied by 1e3 before
  backward is flagged by the watch (z > 6 in loss or total gradient norm).
- :func:`replay_flags_nothing_else`: no other step is flagged.
- :func:`replay_rows_equal_recorded`: the replayed rows at that step equal, to 1e-6
  relative, the rows of a run of the same seed, weights and batches that records every step
  (same keys, no ``replay_mismatch`` row).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from gradscope.claims.verdict import Verdict, not_measured, verdict

FIGURE = "Spike replay (issue 26)"
KEY = ["micro_step", "stack", "layer", "site", "quantity", "layer_j", "role"]
REL = 1e-6


def replay_flags_planted_step(watch: pd.DataFrame, planted: int, *, preset: str) -> Verdict:
    """Holds when the watch flagged ``planted``.

    Args:
        watch: one row per step: ``step``, ``flagged`` and ``z`` (the watch's readings).
        planted: the step whose loss was multiplied by 1e3.
        preset: the analysis preset.
    """
    claim, rule = "the watch flags the step whose loss was multiplied by 1e3", "flagged(planted step): z > 6 in loss or ‖g‖"
    row = watch[watch.step == planted]
    if row.empty:
        return not_measured(FIGURE, claim, rule, preset=preset, detail=f"step {planted} was not run")
    return verdict(FIGURE, claim, rule, {"planted step": planted, "z": float(row.z.iloc[0])},
                   bool(row.flagged.iloc[0]), preset=preset, require_finite=False)


def replay_flags_nothing_else(watch: pd.DataFrame, planted: int, *, preset: str) -> Verdict:
    """Holds when no step but ``planted`` was flagged (the watch's false alarms)."""
    others = sorted(int(s) for s in watch[watch.flagged & (watch.step != planted)].step)
    detail = f"also flagged: {others[:10]}" if others else ""
    return verdict(FIGURE, "no other step is flagged", "#flagged(step != planted) = 0",
                   {"other flagged steps": len(others), "steps watched": len(watch)}, not others, preset=preset,
                   detail=detail)


def replay_rows_equal_recorded(df: pd.DataFrame, planted: int, *, watched: str, always: str, preset: str,
                               rel: float = REL) -> Verdict:
    """Holds when run ``watched``'s replayed rows at ``planted`` equal run ``always``'s
    (recording every step) to ``rel``, with the same keys and no ``replay_mismatch`` row."""
    claim = "the replayed rows equal those of a run recording every step"
    rule = f"same row keys and max |replayed - recorded| / |recorded| <= {rel:g} at the planted step"
    pick = lambda run: df[(df.run == run) & (df.step == planted)  # noqa: E731
                          & ~df.quantity.isin(["replay", "replay_mismatch"])].set_index(KEY).value
    a, b = pick(watched), pick(always)
    if a.empty or b.empty:
        return not_measured(FIGURE, claim, rule, preset=preset, detail=f"no rows at step {planted} in "
                            f"{[r for r, s in ((watched, a), (always, b)) if s.empty]}")
    same_keys = set(a.index) == set(b.index)
    common = a.index.intersection(b.index)
    x, y = a[common].to_numpy(), b[common].to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        diff = np.where(np.isnan(x) & np.isnan(y), 0.0, np.abs(x - y) / np.maximum(np.abs(y), 1e-30))
    worst = float(np.nanmax(diff)) if len(diff) else float("nan")
    mismatch = ((df.run == watched) & (df.quantity == "replay_mismatch")).any()
    detail = "; ".join(d for d in ("" if same_keys else f"{len(set(a.index) ^ set(b.index))} keys in one run only",
                                   "a replay_mismatch row" if mismatch else "") if d)
    return verdict(FIGURE, claim, rule, {"rows compared": len(common), "max relative difference": worst},
                   same_keys and worst <= rel and not mismatch, preset=preset, detail=detail)
