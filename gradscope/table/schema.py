"""The one interchange format: the tidy long table (docs/table.md).

Every recorded number is one row. Matrices (cosine similarities, DLCL weights) are rows
``(layer=i, layer_j=j, value)`` and are pivoted only to plot.

Columns:
    run: free-form run name.
    variant: model variant (``post_ln``...) or the model's class name for foreign models.
    step: optimizer step the row belongs to.
    micro_step: micro-batch index inside a gradient-accumulation step; ``-1`` for values
        of the accumulated step (parameter gradients, the summed loss).
    rank: ``torch.distributed`` rank that measured the value (0 without distributed).
    stack: ``"encoder"``, ``"decoder"`` or ``""`` for model-level rows.
    layer: 1-based layer index for sites inside ``<stack>.layers.<i>`` (module index
        i + 1, as the papers count), 0 for ``<stack>.embed.out``, ``<NA>`` for other
        stack-level rows. For matrix quantities: the row index i.
    site: full site name from the module tree (``decoder.layers.3.cross_attn.norm.in``);
        for parameter norms, the module prefix (``""`` for the total).
    quantity: the quantity's name: a built-in one (``act_grad_norm``, ``param_grad_norm``,
        ``ln_gain``, ``cosine``, ``loss``...: every one, with its definition, in
        :data:`gradscope.recorder.quantities.registry.REGISTRY` and the generated quantity
        reference) or a user quantity's own name.
    value: the number (float64).
    layer_j: column index j of matrix quantities, the head (0-based) of per-head
        quantities, ``<NA>`` otherwise.
    reduction: how the loss was reduced over tokens (``"mean"`` or ``"sum"``), so that
        gradient norms from different runs are comparable.
    role: what the site is, stated once by the recorder's layout for zoo and foreign
        models alike ( ``embed``, ``layer_in``,
        ``layer_out``, ``branch``, ``sum``, ``norm_in``, ``norm_out``, ``final_norm_in``,
        ``final_norm_out``, ``combine``, ``memory``, ``other``: :data:`ROLES`); ``""`` for rows that are
        not at a site (parameter groups, norms' ln_gain, losses). Select on it, never by
        parsing site names.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

import pandas as pd

COLUMNS: tuple[str, ...] = (
    "run",
    "variant",
    "step",
    "micro_step",
    "rank",
    "stack",
    "layer",
    "site",
    "quantity",
    "value",
    "layer_j",
    "reduction",
    "role",
)

DTYPES: dict[str, str] = {
    "run": "string",
    "variant": "string",
    "step": "int64",
    "micro_step": "int64",
    "rank": "int64",
    "stack": "string",
    "layer": "Int64",
    "site": "string",
    "quantity": "string",
    "value": "float64",
    "layer_j": "Int64",
    "reduction": "string",
    "role": "string",
}

ROLES: tuple[str, ...] = (
    "embed", "layer_in", "layer_out", "branch", "sum", "norm_in", "norm_out",
    "final_norm_in", "final_norm_out", "combine", "memory", "other",
)
"""What a site is (the ``role`` column); rows that are not at a site have role ``""``."""

PARAM_ROLES: tuple[str, ...] = ("embedding", "head", "final_norm", "other")
"""What a parameter group outside the layers is (the ``role`` of its ``param_grad_norm``,
``update_ratio`` and ``grad_rms_over_eps`` rows): every parameter of a model is in exactly
one leaf group, and those outside the layers' groups get one of these; the total (site
``""``) and the layers' groups have role ``""``."""

ZOO_SUFFIX_ROLES: tuple[tuple[str, str], ...] = (
    ("final_norm.in", "final_norm_in"), ("final_norm.out", "final_norm_out"), ("norm.in", "norm_in"),
    ("norm.out", "norm_out"), ("embed.out", "embed"), ("combine.out", "combine"), (".branch", "branch"),
    (".sum", "sum"),
)
"""Site-name suffix -> role for the zoo's canonical names (docs/zoo.md, "Sites"): the recorder's layout
decides roles with it, and ``gradscope.io`` reads old tables that have no ``role`` column."""

SWEEP_COLUMNS: tuple[str, ...] = ("run", "variant", "init", "depth", "best_val_loss", "converged")
"""Columns of a depth-sweep summary (a second, per-run table), one row per training run.

run: run name; variant: wiring (``post_ln``...); init: initialisation (``xavier``,
``lipschitz``...); depth: layers per stack (int); best_val_loss: lowest validation loss
in nats (NaN when the run never produced a finite one); converged: bool, decided by
:func:`gradscope.claims.run_outcome`. Written by :func:`gradscope.claims.sweep_summary`,
drawn by :func:`gradscope.plots.depth_sweep`.
"""


def empty_frame() -> pd.DataFrame:
    """Returns an empty table with the canonical columns and dtypes."""
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in DTYPES.items()})


def make_frame(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """Builds a canonical table from row mappings.

    Args:
        rows: mappings with some or all of ``COLUMNS``; missing optional fields get
            defaults (``micro_step=-1``, ``rank=0``, ``layer``/``layer_j`` NA, strings
            ``""``).

    Returns:
        A DataFrame with exactly ``COLUMNS`` in order and ``DTYPES``.

    Raises:
        ValueError: a row has a field that is not a column.
    """
    rows = list(rows)
    for row in rows:
        extra = set(row) - set(COLUMNS)
        if extra:
            raise ValueError(f"unknown table column(s) {sorted(extra)}; valid: {list(COLUMNS)}")
    if not rows:
        return empty_frame()
    df = pd.DataFrame.from_records(rows)
    defaults = {"micro_step": -1, "rank": 0, "run": "", "variant": "", "stack": "", "site": "", "reduction": "mean", "role": ""}
    for col in COLUMNS:
        if col not in df:
            df[col] = defaults.get(col, pd.NA)
        elif col in defaults:
            df[col] = df[col].fillna(defaults[col])
    return df[list(COLUMNS)].astype(DTYPES)


def validate(columns: Iterable[str], *, source: str = "gradscope table", optional: Collection[str] = ()) -> None:
    """Checks that ``columns`` hold every canonical column (extra columns are allowed).

    Args:
        columns: the column names of a DataFrame or of a parquet file.
        source: what the table is, for the message (``"save"``, ``"gradscope.load: <path>"``).
        optional: canonical columns that may be missing (an old file's ``role``).

    Raises:
        ValueError: naming the missing columns.
    """
    present = set(columns)
    missing = [c for c in COLUMNS if c not in present and c not in optional]
    if missing:
        raise ValueError(f"{source}: not a gradscope table, missing columns {missing}")


def concat(parts: Iterable[pd.DataFrame]) -> pd.DataFrame:
    """Tables stacked into one, with the canonical columns and dtypes (empty parts skipped).

    Raises:
        ValueError: a part lacks canonical columns.
    """
    parts = [p for p in parts if len(p)]
    for p in parts:
        validate(p.columns, source="concat")
    if not parts:
        return empty_frame()
    return pd.concat([p[list(COLUMNS)] for p in parts], ignore_index=True).astype(DTYPES)
