"""Recording under ``torch.distributed``: DDP and FSDP2, one table on rank 0.

What each rank records (SPEC §3 columns; ``rank`` is the ``torch.distributed`` rank):

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

import math
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from gradscope.table import concat, empty_frame

PER_RANK_QUANTITIES: tuple[str, ...] = ("act_grad_norm", "act_norm", "loss")
"""Quantities each rank measures on its own part of the batch; combined by :func:`global_rows`."""

SHARED_QUANTITIES: tuple[str, ...] = ("param_grad_norm", "update_ratio", "lr", "dlcl_weight", "scalenorm_g")
"""Quantities every rank holds with the same global value; :func:`global_rows` copies the lowest rank's."""

_POINT = ["run", "variant", "step", "micro_step", "stack", "layer", "site", "role", "quantity", "layer_j", "reduction"]


# -- parameter gradients: squared shard norms summed over the mesh ---------------------------
def reduce_squared_norms(tensors: list[torch.Tensor | None], sq: torch.Tensor) -> torch.Tensor:
    """Turns per-tensor squared local norms into squared global norms.

    ``sq[i]`` is ‖to_local(tensors[i])‖² on this rank. For a DTensor the global ‖t‖² is
    the sum of its local squared norms over every rank of its device mesh, counting each
    distinct element once: along a ``Shard`` mesh dimension the ranks hold disjoint pieces
    (sum them), along a ``Replicate`` dimension they hold copies (so each rank's term is
    divided by the number of copies before summing). ``Partial`` placements must have been
    redistributed to ``Replicate`` beforehand (``gradscope.recorder.params.local`` does).
    Entries of plain tensors are returned unchanged. One ``all_reduce`` (SUM) per mesh
    dimension per distinct mesh — one in all for FSDP2 on a 1-D mesh.

    Every rank of the mesh must call this with the same parameter list (it is collective).

    Args:
        tensors: the tensors (gradients, parameters, updates) in membership order.
        sq: (len(tensors),) squared local norms, 0 where the tensor is None.

    Returns:
        (len(tensors),) squared global norms on ``sq``'s device.
    """
    from torch.distributed.tensor import DTensor

    weight = [0.0] * len(tensors)
    meshes: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, DTensor):
            mesh = t.device_mesh
            copies = math.prod(mesh.size(d) for d, p in enumerate(t.placements) if not p.is_shard())
            weight[i] = 1.0 / copies
            meshes.setdefault(mesh, []).append(i)
    if not meshes:
        return sq
    w = torch.tensor(weight, device=sq.device, dtype=sq.dtype)
    out = torch.where(w == 0, sq, torch.zeros_like(sq))  # plain tensors: already global
    for mesh, idx in meshes.items():
        part = torch.zeros_like(sq)
        index = torch.tensor(idx, device=sq.device)
        part[index] = sq[index] * w[index]
        for d in range(mesh.ndim):
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=mesh.get_group(d))
        out = out + part
    return out


# -- one table on one rank -------------------------------------------------------------------
def gather_frame(source: Any, *, dst: int = 0, group: Any = None) -> pd.DataFrame | None:
    """Gathers every rank's rows into one table on rank ``dst``.

    Collective: every rank of ``group`` must call it (a call on rank 0 alone hangs). Uses
    ``torch.distributed.gather_object`` once. With NCCL, call
    ``torch.cuda.set_device(local_rank)`` first (a ``gather_object`` requirement).

    Args:
        source: a ``Recorder`` (its ``frame()`` is taken) or a table.
        dst: global rank that receives the table.
        group: process group (default: the world).

    Returns:
        On ``dst``: all ranks' rows, in rank order, with the canonical dtypes. On other
        ranks: None. Without an initialised process group: ``source``'s own table.
    """
    df = source if isinstance(source, pd.DataFrame) else source.frame()
    if not (dist.is_available() and dist.is_initialized()):
        return df
    is_dst = dist.get_rank() == dst
    frames = [None] * dist.get_world_size(group) if is_dst else None
    dist.gather_object(df, frames, dst=dst, group=group)
    if not is_dst:
        return None
    return concat(f for f in frames if f is not None)


# -- rank -1: all ranks together -------------------------------------------------------------
def global_rows(df: pd.DataFrame, world_size: int | None = None, reduction: str | None = None,
                quantities: tuple[str, ...] = PER_RANK_QUANTITIES + SHARED_QUANTITIES) -> pd.DataFrame:
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
    of norms or a sampled statistic does not combine from per-rank values).

    Args:
        df: a gathered table (:func:`gather_frame`) holding every rank's rows.
        world_size: number of ranks W (default: the number of distinct ranks in ``df``).
        reduction: ``"mean"`` or ``"sum"``; default: each row's ``reduction`` column.
        quantities: which quantities to combine or copy.

    Returns:
        A canonical table of the rank -1 rows (empty if ``df`` has none to combine).

    Raises:
        ValueError: ``df`` holds rows of fewer or more ranks than ``world_size``, a point
            lacks some rank's row, or ``reduction`` is not ``"mean"``/``"sum"``.
    """
    if reduction not in (None, "mean", "sum"):
        raise ValueError(f"reduction: must be 'mean', 'sum' or None, got {reduction!r}")
    rows = df[(df["rank"] >= 0) & df["quantity"].isin(quantities)]
    ranks = sorted(int(r) for r in rows["rank"].unique())
    W = world_size if world_size is not None else len(ranks)
    if rows.empty:
        return empty_frame()
    if len(ranks) != W:
        raise ValueError(f"rows from ranks {ranks}, but world_size={W}: gather every rank's rows first (gather_frame)")
    if reduction is not None:
        rows = rows.assign(reduction=reduction)
    shared = rows[rows["quantity"].isin(SHARED_QUANTITIES) & (rows["rank"] == ranks[0])]
    per_rank = rows[rows["quantity"].isin(PER_RANK_QUANTITIES)]
    parts = [shared.assign(rank=-1)]
    if not per_rank.empty:
        v = per_rank["value"].to_numpy(np.float64)
        grouped = per_rank.assign(sq=v * v, nan=np.isnan(v)).groupby(_POINT, dropna=False, sort=False)
        stats = grouped.agg(sq=("sq", "sum"), total=("value", "sum"), nan=("nan", "any"), n=("value", "size")).reset_index()
        short = stats[stats["n"] != W]
        if len(short):
            first = short.iloc[0]
            raise ValueError(f"{first['quantity']} at step {first['step']} site {first['site']!r}: "
                             f"{first['n']} rank rows, expected {W}")
        mean = (stats["reduction"] == "mean").to_numpy()
        norm = np.sqrt(stats["sq"].to_numpy(np.float64))
        value = np.where(stats["quantity"] == "act_grad_norm", np.where(mean, norm / W, norm), norm)
        value = np.where(stats["quantity"] == "loss", np.where(mean, stats["total"] / W, stats["total"]), value)
        value = np.where(stats["nan"], np.nan, value)  # pandas sums skip NaN: a NaN on any rank stays NaN
        parts.append(stats[_POINT].assign(value=value, rank=-1))
    return concat(parts)


def global_act_grad_norms(df: pd.DataFrame, world_size: int | None = None, reduction: str | None = None) -> pd.DataFrame:
    """``act_grad_norm`` rows with ``rank = -1``: ‖∂L/∂h‖ over the whole batch.

    ``sqrt(Σ_r ‖g_r‖²)/W`` for a mean-reduced loss, ``sqrt(Σ_r ‖g_r‖²)`` for a summed one
    (derivation in the module docstring); see :func:`global_rows` for the arguments.
    """
    return global_rows(df, world_size, reduction, quantities=("act_grad_norm",))
