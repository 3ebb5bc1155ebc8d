"""Recording under ``torch.distributed``: DDP and FSDP2, one table on rank 0.

What each rank records (the table's columns, docs/table.md; ``rank`` is the ``torch.distributed`` rank):

- ``param_grad_norm`` / ``update_ratio`` are **global** on every rank. DDP all-reduces
  (averages) ``p.grad`` during ``backward()``, and the recorder reads ``p.grad`` when the
  step context closes, after backward. FSDP2 leaves ``p.grad`` as a DTensor whose
  ``to_local()`` is this rank's shard; the recorder sums the squared shard norms over the
  device mesh with one ``all_reduce`` per recorded step (:func:`reduce_squared_norms`).
- ``act_grad_norm``, ``act_norm`` and ``loss`` are **per rank**: each rank sees only its
  own part of the batch. :func:`global_rows` combines them into rows with ``rank = -1``
  (the convention for "all ranks together") that equal a single-process run on the whole
  batch.

Activation gradients across ranks (equal per-rank batches). With ``W`` ranks, rank r's
loss is ``loss_r`` over its part of the batch and ``g_r = ∂loss_r/∂h_r`` is what its hook
sees. DDP and FSDP2 average parameter gradients, i.e. they optimise ``(1/W)·Σ_r loss_r``.

- ``reduction="mean"``: the whole-batch mean loss is ``L = (1/W)·Σ_r loss_r`` (equal
  numbers of averaged elements per rank), so ``∂L/∂h`` restricted to rank r's rows is
  ``g_r/W`` and ``‖∂L/∂h‖ = sqrt(Σ_r ‖g_r‖²)/W``.
- ``reduction="sum"``: ``L = Σ_r loss_r``, so ``‖∂L/∂h‖ = sqrt(Σ_r ‖g_r‖²)``. Note that
  ``p.grad`` is then ``(1/W)·∂L/∂θ`` (DDP still averages), and ``param_grad_norm``, which
  is ‖p.grad‖ as the optimizer sees it, is the whole-batch value divided by W.

With padding ignored by a mean-reduced loss, ranks average over different token counts
and the mean-case identity holds only approximately (as it does for DDP's gradient).

Usage (every rank runs the same code)::

    model = DDP(gradscope.build_model(cfg))        # or fully_shard(...) for FSDP2
    rec = gradscope.Recorder(model)                 # DDP is unwrapped; rank read from dist
    ...                                             # with rec.step(s): forward, backward
    df = rec.frame(gather=True)                     # collective: all ranks' rows on rank 0
    if df is not None:                              # None on the other ranks
        df = pd.concat([df, global_rows(df)])

Runnable example (CPU, gloo), in :mod:`gradscope.distributed_demo`::

    torchrun --nproc-per-node 2 -m gradscope.distributed_demo --steps 3 --out runs/ddp.parquet
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from gradscope.recorder.numerics.collectives import gather_frame, reduce_squared_norms  # noqa: F401  (public here)
from gradscope.recorder.quantities.registry import REGISTRY
from gradscope.recorder.quantities.combine import COMBINE, combine
from gradscope.recorder.quantities.quantity import Quantity
from gradscope.table import DTYPES, concat, empty_frame

__all__ = ["gather_frame", "global_act_grad_norms", "global_rows", "reduce_squared_norms"]

RANK_RULES: dict[str, str] = {n: q.across_ranks for q in REGISTRY.values() for n in q.names}
"""Built-in quantity -> how ranks combine it (each quantity's ``across_ranks``)."""

PER_RANK_QUANTITIES: tuple[str, ...] = tuple(n for n, r in RANK_RULES.items() if r not in ("shared", "local"))
"""Quantities each rank measures on its own part of the batch; combined by :func:`global_rows`."""

SHARED_QUANTITIES: tuple[str, ...] = tuple(n for n, r in RANK_RULES.items() if r == "shared")
"""Quantities every rank holds with the same global value; :func:`global_rows` copies the lowest rank's."""

_POINT = ["run", "variant", "step", "micro_step", "stack", "layer", "site", "role", "quantity", "layer_j", "reduction"]


# -- rank -1: all ranks together -------------------------------------------------------------
def global_rows(df: pd.DataFrame, world_size: int | None = None, reduction: str | None = None,
                quantities: tuple[str, ...] = PER_RANK_QUANTITIES + SHARED_QUANTITIES,
                extra: tuple[Quantity, ...] = ()) -> pd.DataFrame:
    """Rows with ``rank = -1``: the values of a single-process run on the whole batch.

    ``rank = -1`` means "all ranks together"; rows with ``rank >= 0`` are what one rank
    measured. Per-rank quantities are combined over ranks (module docstring for the
    derivation), per (run, step, micro_step, site, ...) point:

    - ``act_grad_norm``: ``sqrt(Σ_r v_r²)/W`` for ``reduction="mean"``, ``sqrt(Σ_r v_r²)``
      for ``"sum"`` — the norm of ∂L/∂h over the whole batch.
    - ``act_norm``: ``sqrt(Σ_r v_r²)``, the norm of the whole-batch activation.
    - ``loss``: the mean over ranks (``"mean"``) or the sum (``"sum"``).
    - ``param_grad_norm``, ``update_ratio``, ``lr``, ``dlcl_weight``, ``scalenorm_g``:
      already global on every rank; the lowest rank's value is copied.

    ``ln_gain``, ``ln_w_over_sigma``, ``cosine`` and ``nonfinite`` stay per rank (a ratio
    of norms or a sampled statistic does not combine from per-rank values). Each rule is the
    quantity's ``across_ranks``; a user's own quantities, passed in ``extra``, are combined
    by theirs (``max``, ``mean``, ``rss``...).

    Args:
        df: a gathered table (:func:`gather_frame`) holding every rank's rows.
        world_size: number of ranks W (default: the number of distinct ranks in ``df``).
        reduction: ``"mean"`` or ``"sum"``; default: each row's ``reduction`` column.
        quantities: which built-in quantities to combine or copy.
        extra: user quantities (:class:`gradscope.Quantity` instances) to combine too.

    Returns:
        A canonical table of the rank -1 rows (empty if ``df`` has none to combine).

    Raises:
        ValueError: ``df`` holds rows of fewer or more ranks than ``world_size``, a point
            lacks some rank's row, or ``reduction`` is not ``"mean"``/``"sum"``.
    """
    if reduction not in (None, "mean", "sum"):
        raise ValueError(f"reduction: must be 'mean', 'sum' or None, got {reduction!r}")
    for q in extra:
        if not isinstance(q, Quantity):
            made = f" (a class: pass an instance, {q.__name__}())" if isinstance(q, type) else ""
            raise TypeError(f"global_rows: extra holds {q!r}, not a gradscope.Quantity instance{made}")
        q.check()
    rules = {n: RANK_RULES[n] for n in quantities if n in RANK_RULES}
    rules.update({q.name: q.across_ranks for q in extra})
    df = df.astype({c: DTYPES[c] for c in ("layer", "layer_j", "step", "micro_step", "rank") if c in df})
    rows = df[(df["rank"] >= 0) & df["quantity"].isin([n for n, r in rules.items() if r != "local"])]
    ranks = sorted(int(r) for r in rows["rank"].unique())
    W = world_size if world_size is not None else len(ranks)
    if rows.empty:
        return empty_frame()
    if len(ranks) != W:
        raise ValueError(f"rows from ranks {ranks}, but world_size={W}: gather every rank's rows first (gather_frame)")
    if reduction is not None:
        rows = rows.assign(reduction=reduction)
    shared = rows[rows["quantity"].map(rules).eq("shared") & (rows["rank"] == ranks[0])]
    per_rank = rows[~rows["quantity"].map(rules).eq("shared")]
    parts = [shared.assign(rank=-1)]
    if not per_rank.empty:
        v = per_rank["value"].to_numpy(np.float64)
        grouped = per_rank.assign(sq=v * v, nan=np.isnan(v)).groupby(_POINT, dropna=False, sort=False)
        stats = grouped.agg(sq=("sq", "sum"), total=("value", "sum"), nan=("nan", "any"), n=("value", "size")).reset_index()
        short = stats[stats["n"] != W]
        if len(short):
            first = short.iloc[0]
            steps = {r: sorted(int(x) for x in g["step"].unique()) for r, g in rows.groupby("rank")}
            differ = len({tuple(v) for v in steps.values()}) > 1
            why = (f": the ranks recorded different steps ({'; '.join(f'rank {r}: {_few(v)}' for r, v in steps.items())}); "
                   "every rank must record the same steps (the same every= and step indices)") if differ else ""
            raise ValueError(f"{first['quantity']} at step {first['step']} site {first['site']!r}: "
                             f"{first['n']} rank rows, expected {W}{why}")
        mean = (stats["reduction"] == "mean").to_numpy()
        norm = np.sqrt(stats["sq"].to_numpy(np.float64))
        rule = stats["quantity"].map(rules).to_numpy()
        value = np.where(rule == "gradient_norm", np.where(mean, norm / W, norm), norm)
        value = np.where(rule == "loss", np.where(mean, stats["total"] / W, stats["total"]), value)
        for how in set(rule) & (set(COMBINE) - {"rss"}):  # a user quantity's rule
            at = rule == how
            value[at] = _combine_ranks(per_rank, stats[at], how)
        value = np.where(stats["nan"], np.nan, value)  # pandas sums skip NaN: a NaN on any rank stays NaN
        parts.append(stats[_POINT].assign(value=value, rank=-1))
    return concat(parts)


def _combine_ranks(per_rank: pd.DataFrame, points: pd.DataFrame, how: str) -> np.ndarray:
    """The ranks' values of each of ``points`` combined by ``how`` (:data:`COMBINE`)."""
    keyed = per_rank.merge(points[_POINT], on=_POINT, how="inner")
    values = keyed.groupby(_POINT, dropna=False, sort=False)["value"].apply(
        lambda v: float(combine(v.to_numpy(np.float64), how)))
    return points[_POINT].merge(values.reset_index(), on=_POINT, how="left")["value"].to_numpy(np.float64)


def global_act_grad_norms(df: pd.DataFrame, world_size: int | None = None, reduction: str | None = None) -> pd.DataFrame:
    """``act_grad_norm`` rows with ``rank = -1``: ‖∂L/∂h‖ over the whole batch.

    ``sqrt(Σ_r ‖g_r‖²)/W`` for a mean-reduced loss, ``sqrt(Σ_r ‖g_r‖²)`` for a summed one
    (derivation in the module docstring); see :func:`global_rows` for the arguments.
    """
    return global_rows(df, world_size, reduction, quantities=("act_grad_norm",))


def _few(steps: list[int]) -> str:
    """A list of steps, shortened past six."""
    return str(steps) if len(steps) <= 6 else f"[{', '.join(map(str, steps[:3]))}, ..., {steps[-1]}] ({len(steps)} steps)"
