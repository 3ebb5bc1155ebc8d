"""How the values of one point combine (micro-steps into a step's row, ranks into rank −1),
and the row type every quantity writes."""

from __future__ import annotations

import math

import numpy as np

from gradscope.table.keys import Key

Row = tuple[Key, float]
"""One table row as a quantity writes it: its key and its value."""

COMBINE: tuple[str, ...] = ("max", "min", "sum", "mean", "rss", "rms")
"""How several values of one point combine (micro-steps into the step's row, ranks into
rank -1): largest, smallest, sum, mean, root of the sum of squares (a norm over the
concatenated tensors), root of the mean of squares."""


def combine(values: np.ndarray, how: str, axis: int = 0) -> np.ndarray:
    """Combines values along ``axis`` by ``how`` (:data:`COMBINE`); NaN stays NaN."""
    if how == "max":
        return values.max(axis=axis)
    if how == "min":
        return values.min(axis=axis)
    if how == "sum":
        return values.sum(axis=axis)
    if how == "mean":
        return values.mean(axis=axis)
    if how == "rss":
        return np.sqrt(np.square(values).sum(axis=axis))
    if how == "rms":
        return np.sqrt(np.square(values).mean(axis=axis))
    raise ValueError(f"combine: {how!r}; valid: {list(COMBINE)}")


def ratio(a: float, b: float) -> float:
    """a / b, with 0/0 = NaN and a/0 = inf."""
    return a / b if b != 0 else (math.nan if a == 0 else math.inf)
