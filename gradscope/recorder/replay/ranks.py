"""The spike watch under ``torch.distributed``: the total gradient norm over DTensor gradients
on any device mesh, and one verdict that every rank shares.

- **‖g‖** is ``torch.nn.utils.get_total_norm`` over the gradients, the reduction
  ``clip_grad_norm_`` makes. When every gradient is a DTensor on one device mesh (FSDP2 on a
  1-D mesh, HSDP, a tensor-parallel plan that covers every parameter) that is a DTensor too,
  and ``clip_grads_with_norm_(params, max_norm, rec.grad_norm)`` clips exactly as
  ``clip_grad_norm_`` would. Gradients on several meshes, or DTensors next to plain tensors
  (FSDP2 over tensor parallelism with norms left out of the plan; tensor parallelism with
  plain norms), make ``clip_grad_norm_`` raise; the watch then takes ``get_total_norm`` of
  each mesh's gradients (and of the plain ones, which hold the whole gradient on each rank:
  replicas, or all-reduced by DDP) and the 2-norm of those norms, a plain tensor.
- **The verdict**: each rank's loss is its own, so the two numbers the watch judges are their
  means over the ranks of the default process group, one ``all_reduce`` (SUM) of both. ‖g‖
  is the same on every rank under DDP, FSDP2 and tensor parallelism, so its mean is itself
  (to a rounding for a world size that is not a power of two). Every rank then judges the
  same two numbers with the same window and takes the same decision: all replay together,
  and a replay's collectives (DDP's all-reduce, FSDP2's all-gather and reduce-scatter, the
  recorder's own) are met on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradscope.recorder.capture.params import is_dtensor


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """‖g‖₂ over the gradients, as ``clip_grad_norm_`` reduces them where it can.

    Args:
        grads: the gradients (plain tensors or DTensors).

    Returns:
        0-d: ``get_total_norm(grads)`` (a DTensor when every gradient is one, on one mesh), or,
        for gradients on several meshes or DTensors beside plain tensors, the 2-norm of each
        mesh's (and the plain tensors') ``get_total_norm``, a plain tensor.
    """
    if not grads:
        return torch.zeros(())
    if all(type(g) is torch.Tensor for g in grads):  # (no DTensor: the usual case, read at every step)
        return torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=None)
    by_mesh: dict = {}  # in order of first use: the same on every rank (a set's order is not), so are the collectives
    for g in grads:
        by_mesh.setdefault(g.device_mesh if is_dtensor(g) else None, []).append(g)
    if len(by_mesh) == 1:
        return torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=None)
    norms = [plain(torch.nn.utils.get_total_norm(part, 2.0, error_if_nonfinite=False, foreach=None))
             for part in by_mesh.values()]
    device = grads[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)


def plain(norm: torch.Tensor) -> torch.Tensor:
    """The value of a 0-d norm as a plain tensor (a DTensor's full tensor: collective if Partial)."""
    return norm.full_tensor() if is_dtensor(norm) else norm


def world_size() -> int:
    """Ranks in the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """The watch's numbers averaged over the ranks (one ``all_reduce``; itself on one rank).

    Every rank of the default process group must call it at every watched step, with the
    same shape (it is collective).
    """
    n = world_size()
    if n == 1:
        return values
    values = values.clone()
    if values.device.type == "cpu" and dist.get_backend() == "nccl":  # (a step without gradients: a norm made on the host)
        values = values.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values / n
