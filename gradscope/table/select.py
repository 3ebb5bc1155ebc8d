"""Row selection shared by :mod:`gradscope.plots` and :mod:`gradscope.claims` (pure pandas).

Every function here returns a new frame and never writes into its input.

Conventions used by every plot and claim:

- **Step.** A ``step`` argument is an ``int`` or ``"first"`` / ``"last"``; the words are
  resolved per run (a run's first or last step among the selected rows), so runs logged
  at different steps can share a panel.
- **One value per point.** Several rows for the same point (micro-batches, ranks) are
  reduced by :func:`one_per_point`: the accumulated-step row (``micro_step == -1``) when
  there is one, else the mean over micro-batches and ranks. A point with any non-finite
  row becomes NaN, so a divergence is never averaged away.
- **Layers and sites.** The ``layer`` column is the x axis, and sites are chosen by the
  ``role`` column the recorder wrote (``layer_out``, ``embed``, ``norm_in``...), the same
  for zoo and foreign models. Site names are never parsed, with one documented exception:
  :func:`sublayer`, for the sub-layer a zoo site sits in (Takase's locations need it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal, Union

import numpy as np
import pandas as pd

StepSpec = Union[int, Literal["first", "last"]]

LOCATIONS: tuple[tuple[str, str, str], ...] = (
    ("self_attn", "norm_in", "(1) LN1 in"),
    ("self_attn", "norm_out", "(2) LN1 out"),
    ("cross_attn", "norm_in", "(3) LN2 in"),
    ("cross_attn", "norm_out", "(4) LN2 out"),
    ("ffn", "norm_in", "(5) LN3 in"),
)
"""Takase (2022) Fig. 4 locations (1)-(5) in a Post-LN decoder layer: (sub-layer, role, label).

Location (1) is the input of the self-attention sub-layer's norm (x + SA(x) in Post-LN),
(2) its output, (3)/(4) the same for cross-attention, (5) the input of the FFN's norm.
"""

_POINT_KEYS = ["run", "variant", "step", "stack", "layer", "layer_j", "site", "role", "quantity", "reduction"]


def rows(
    df: pd.DataFrame,
    *,
    quantity: str | None = None,
    stack: str | None = None,
    run: str | None = None,
    variant: str | None = None,
    role: str | Sequence[str] | None = None,
) -> pd.DataFrame:
    """Rows matching every given column value (``None`` leaves a column unfiltered).

    ``role`` may be one role or several (``("layer_out", "embed")``).
    """
    keep = pd.Series(True, index=df.index)
    for col, val in (("quantity", quantity), ("stack", stack), ("run", run), ("variant", variant)):
        if val is not None:
            keep &= (df[col] == val).fillna(False).astype(bool)
    if role is not None:
        keep &= df["role"].isin([role] if isinstance(role, str) else list(role)).fillna(False).astype(bool)
    return df.loc[keep]


_SUBLAYER = re.compile(r"\.layers\.\d+\.([^.#]+)\.")


def sublayer(sites: pd.Series) -> pd.Series:
    """Sub-layer holding each site of a zoo model: ``self_attn``, ``cross_attn``, ``ffn``...

    The one place outside the recorder that reads a site name. The ``role`` column says what
    a site is (``norm_in``) and ``layer`` where it is, but not which of a layer's sub-layers
    it belongs to, which Takase's locations (:data:`LOCATIONS`) need. Zoo names are
    ``<stack>.layers.<i>.<sublayer>.<...>`` (docs/zoo.md, "Sites"), and a norm's own name (the ``site``
    of ``ln_gain`` rows) has the same form.

    Args:
        sites: site names.

    Returns:
        Per site, the name of the layer's child module that holds it (the part after
        ``.layers.<i>.``: ``input_layernorm`` in a Llama ``model.layers.3.input_layernorm.in``);
        ``""`` for sites that are not inside a layer's child (layer inputs/outputs,
        embeddings, final norms, block lists not called ``layers``).
    """
    return sites.astype("string").str.extract(_SUBLAYER, expand=False).fillna("")


def at_step(df: pd.DataFrame, step: StepSpec) -> tuple[pd.DataFrame, dict[str, int]]:
    """Rows at one step per run.

    Args:
        df: table rows.
        step: an optimizer step, or ``"first"`` / ``"last"`` (each run's own first or last
            step among ``df``).

    Returns:
        The rows, and the resolved step of each run that has rows there.
    """
    if df.empty:
        return df, {}
    if isinstance(step, str):
        if step not in ("first", "last"):
            raise ValueError(f"step must be an int, 'first' or 'last', got {step!r}")
        chosen = df.groupby("run", sort=True)["step"].agg("min" if step == "first" else "max")
        wanted = df["run"].map(chosen)
        out = df.loc[(df["step"] == wanted).fillna(False).astype(bool)]
    else:
        out = df.loc[df["step"] == int(step)]
    steps = {str(r): int(s) for r, s in out.groupby("run", sort=True)["step"].first().items()}
    return out, steps


def step_rows_only(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` without the micro-batches' rows of an accumulated step (``micro_step`` ≥ 0)
    where the step has its own rows (``micro_step`` −1) of that quantity: one row per step
    and point, the step's value. A quantity whose step has micro-batch rows only (a user's
    ``rows()`` that writes no step row) keeps them, so nothing is hidden."""
    micro = df["micro_step"].to_numpy() != -1
    if not micro.any():
        return df
    keys = [df[c] for c in ("run", "rank", "step", "quantity") if c in df]
    has_step_row = (~pd.Series(micro, index=df.index)).groupby(keys, observed=True, dropna=False).transform("any")
    return df[~(micro & has_step_row.to_numpy())].reset_index(drop=True)


def one_per_point(df: pd.DataFrame) -> pd.DataFrame:
    """Reduces to one row per point; adds ``n``, the number of rows reduced.

    Keeps the ``micro_step == -1`` row of a point when it has one, else averages over
    micro-batches and ranks; a point with a non-finite row gets ``value`` NaN.
    """
    if df.empty:
        return pd.DataFrame(columns=[*_POINT_KEYS, "value", "n"])
    keys = [df[k] for k in _POINT_KEYS]
    accumulated = df["micro_step"] == -1
    has_acc = accumulated.groupby(keys, dropna=False).transform("any")
    kept = df.loc[accumulated | ~has_acc]
    out = _strict_mean(kept["value"], [kept[k] for k in _POINT_KEYS])
    return out.reset_index()


def _strict_mean(values: pd.Series, keys: list[pd.Series]) -> pd.DataFrame:
    """Group means (``value``) and sizes (``n``); NaN where a group holds a non-finite value."""
    finite = values.where(np.isfinite(values.to_numpy(dtype=float)))
    stats = finite.groupby(keys, dropna=False, sort=True).agg(["mean", "count", "size"])
    value = stats["mean"].where(stats["count"] == stats["size"])
    return pd.DataFrame({"value": value.astype(float), "n": stats["size"]})


def single_run(df: pd.DataFrame, *, run: str | None = None, variant: str | None = None) -> pd.DataFrame:
    """Rows of exactly one run, chosen by name or by variant.

    Returns:
        The run's rows; empty when no run matches.

    Raises:
        ValueError: the variant covers several runs (pass ``run``, or filter first).
    """
    out = rows(df, run=run, variant=variant)
    names = sorted(out["run"].dropna().unique())
    if len(names) > 1:
        raise ValueError(f"variant {variant!r} covers runs {names}; pass run= or filter the table")
    return out


def check_one_run_per_hue(df: pd.DataFrame, hue: str) -> None:
    """Raises ValueError when one hue value covers several runs (they would be mixed)."""
    if hue == "run" or df.empty:
        return
    counts = df.groupby(hue, dropna=False)["run"].nunique()
    many = counts[counts > 1]
    if len(many):
        runs = {str(h): sorted(df.loc[df[hue] == h, "run"].unique()) for h in many.index}
        raise ValueError(f"hue {hue!r} mixes runs {runs}; filter the table or use hue='run'")


def hue_values(df: pd.DataFrame, hue: str, hue_order: Sequence[str] | None) -> list[str]:
    """Hue levels to draw: ``hue_order`` if given (levels absent from ``df`` skipped), else sorted."""
    present = [str(v) for v in df[hue].dropna().unique()]
    if hue_order is None:
        return sorted(present)
    return [h for h in hue_order if h in present]


def layer_series(points: pd.DataFrame) -> pd.Series:
    """Mean value per layer (over the sites of a layer), indexed by the int layer, sorted."""
    pts = points.loc[points["layer"].notna()]
    series = _strict_mean(pts["value"], [pts["layer"].astype(int)])["value"]
    return series.astype(float)


def layer_depth(df: pd.DataFrame, stack: str) -> int | None:
    """Number of layers of ``stack``: the largest ``layer`` among its rows, matrix rows
    (whose ``layer`` is a matrix index) left out; None when it has no layer rows."""
    sub = rows(df, stack=stack)
    layers = sub.loc[sub["layer_j"].isna(), "layer"].dropna()
    return int(layers.max()) if len(layers) else None


def default_layers(depth: int) -> tuple[int, ...]:
    """Layers Takase Fig. 4/7 looks at, scaled to ``depth``: (1, depth // 2, depth), deduplicated.

    At 18 layers this is the paper's (1, 9, 18).
    """
    return tuple(sorted({1, max(1, depth // 2), depth}))


def location_values(points: pd.DataFrame, layer: int) -> np.ndarray:
    """Values at the five :data:`LOCATIONS` of one layer (NaN where a site is absent).

    Args:
        points: rows of one run, one stack and one quantity (e.g. from :func:`one_per_point`).
        layer: 1-based layer.
    """
    at_layer = points.loc[(points["layer"] == layer).fillna(False).astype(bool)]
    part = sublayer(at_layer["site"])
    out = []
    for sub, role, _ in LOCATIONS:
        hit = at_layer.loc[((part == sub) & (at_layer["role"] == role)).fillna(False).astype(bool), "value"]
        out.append(float(hit.mean()) if len(hit) else np.nan)
    return np.asarray(out, dtype=float)


def stack_of(df: pd.DataFrame, stack: str | None, *, quantity: str, zoo_default: str, caller: str) -> str:
    """The stack a plot draws: ``stack`` when given; else the only stack with ``quantity`` rows
    (any model with one block list: ``"transformer.h"``, ``"model.layers"``...); in a table
    with several (a zoo encoder–decoder), ``zoo_default`` when it is one of them.

    Raises:
        ValueError: several stacks and none is ``zoo_default`` (naming them), or no
            ``quantity`` rows in any stack.
    """
    if stack is not None:
        return stack
    found = set(df.loc[df["quantity"] == quantity, "stack"].dropna().astype(str))
    named = sorted(found - {""})
    if len(named) == 1 or (not named and found):
        return named[0] if named else ""
    if zoo_default in named:
        return zoo_default
    if not named:
        raise ValueError(f"{caller}: no {quantity} rows in any stack")
    raise ValueError(f"{caller}: the table has {quantity} rows in several stacks {named}; pass stack= one of them")


def one_matrix(
    df: pd.DataFrame, quantity: str, *, run: str | None, variant: str | None, stack: str,
    step: StepSpec, site: str | None = None,
) -> tuple[np.ndarray, str, int | None]:
    """The matrix of one run (and one site) at one step.

    Args:
        df: tidy table.
        quantity: ``cosine`` or ``dlcl_weight``.
        run: run name; overrides ``variant``.
        variant: variant whose single run is used.
        stack: stack of the matrix.
        step: step or ``"first"`` / ``"last"``.
        site: the matrix's site, needed only when the stack has several.

    Returns:
        The array (see :func:`matrix`; 0×0 when there are no rows), the run name and the
        resolved step (``""`` and None when there are no rows).

    Raises:
        ValueError: several runs or several sites match.
    """
    data = single_run(rows(df, quantity=quantity, stack=stack), run=run,
                      variant=None if run is not None else variant)
    if site is not None:
        data = data.loc[(data["site"] == site).fillna(False).astype(bool)]
    sites = sorted(data["site"].dropna().unique())
    if len(sites) > 1:
        raise ValueError(f"{quantity} rows come from sites {sites}; pass site=")
    data, steps = at_step(data, step)
    if not steps:
        return np.zeros((0, 0)), "", None
    ((name, resolved),) = steps.items()
    return matrix(one_per_point(data)), name, resolved


def matrix(points: pd.DataFrame) -> np.ndarray:
    """Pivots matrix rows (``layer`` = i, ``layer_j`` = j) to an array, NaN where absent.

    The shape is (max i + 1, max j + 1): square for cosine and DLCL W, (N+1)×M for
    transparent attention.
    """
    pts = points.loc[points["layer"].notna() & points["layer_j"].notna()]
    if pts.empty:
        return np.zeros((0, 0))
    i = pts["layer"].astype(int).to_numpy()
    j = pts["layer_j"].astype(int).to_numpy()
    out = np.full((int(i.max()) + 1, int(j.max()) + 1), np.nan)
    out[i, j] = pts["value"].to_numpy(dtype=float)
    return out


def dlcl_mask(w: np.ndarray, abs_threshold: float, rel_threshold: float) -> np.ndarray:
    """Wang (2019) Fig. 5 mask: True where a cell is hidden.

    A cell is hidden when it is missing (NaN: the recorder stores DLCL W's lower triangle
    only), ``|w| < abs_threshold``, or ``|w| < rel_threshold * max_k |w[r, k]|`` (its
    row's largest magnitude).
    """
    a = np.abs(w)
    row_max = np.max(np.where(np.isnan(a), -np.inf, a), axis=1, keepdims=True) if a.size else a
    with np.errstate(invalid="ignore"):
        return np.isnan(a) | (a < abs_threshold) | (a < rel_threshold * row_max)


NONFINITE_QUANTITIES = ("nonfinite", "nonfinite_grad")
"""Recorder rows naming a site whose forward value / gradient held a NaN or Inf (the value
is the order of appearance, 0 first): any such row marks a divergence."""


def divergence_step(df: pd.DataFrame, points: pd.DataFrame) -> int | None:
    """First step of a run with a non-finite loss point or a ``nonfinite(_grad)`` row.

    Args:
        df: the run's raw table rows (any quantities).
        points: the run's loss points from :func:`one_per_point`.
    """
    bad = points.loc[~np.isfinite(points["value"].to_numpy(dtype=float)), "step"]
    flagged = df.loc[df["quantity"].isin(NONFINITE_QUANTITIES).fillna(False).astype(bool), "step"]
    steps = [int(s) for s in (*bad, *flagged)]
    return min(steps) if steps else None


def reduction_text(df: pd.DataFrame) -> str:
    """How the loss behind ``df`` was reduced over tokens, for axis labels."""
    vals = sorted({str(r) for r in df["reduction"].dropna().unique() if str(r)}) if "reduction" in df else []
    if not vals:
        return "reduction not recorded"
    if len(vals) == 1:
        return f"{vals[0]} over tokens"
    return f"mixed reductions: {'/'.join(vals)} over tokens"
