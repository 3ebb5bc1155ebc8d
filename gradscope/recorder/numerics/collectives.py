"""The two collectives the recorder runs under ``torch.distributed`` (FSDP2 gradient norms,
gathering tables); :mod:`gradscope.distributed` explains the rules and re-exports them."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from gradscope.table import concat


# -- parameter gradients: squared shard norms summed over the mesh ---------------------------
def reduce_squared_norms(tensors: list[torch.Tensor | None], sq: torch.Tensor) -> torch.Tensor:
    """Turns per-tensor squared local norms into squared global norms.

    ``sq[i]`` is ‖to_local(tensors[i])‖² on this rank. For a DTensor the global ‖t‖² is
    the sum of its local squared norms over every rank of its device mesh, counting each
    distinct element once: along a ``Shard`` or ``_StridedShard`` mesh dimension the ranks
    hold disjoint pieces (sum them), along a ``Replicate`` dimension they hold copies (so
    each rank's term is divided by the number of copies before summing), on 1-D, 2-D (FSDP2
    over tensor parallelism, HSDP) and 3-D meshes alike. ``Partial`` placements must have been
    redistributed to ``Replicate`` beforehand (``gradscope.recorder.capture.params.local`` does).
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
            # a dimension holds copies where it replicates, or is Partial (redistributed to Replicate
            # before the local norms were taken); every other is sharded: Shard, and _StridedShard (FSDP2
            # over tensor parallelism), which is no Shard and says is_shard() False (torch 2.13)
            copies = math.prod(mesh.size(d) for d, p in enumerate(t.placements) if p.is_replicate() or p.is_partial())
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


def dist_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0

