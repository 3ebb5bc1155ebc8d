"""The largest singular value of a weight matrix by power iteration, warm-started from the
vector the last call left (Miyato et al. 2018, Algorithm 1, as ``torch.nn.utils.spectral_norm``
keeps ``u`` between forwards): the weights change a little between calls, so a few
iterations per call keep the estimate converged at a cost of 2 matrix-vector products each.

The estimate σ̂ = ‖Wᵀu‖ with ‖u‖ = 1 is never above σ₁ = ‖W‖₂, and it does not decrease from
one iteration to the next on a fixed W (a Rayleigh quotient of WᵀW under power iteration).
Its relative error after k iterations from a vector with component c on the top right
singular vector is about (σ₂/σ₁)^(2k)·(1 − c²)/c²: fast when the top two singular values are
apart, slow when they nearly tie (then σ̂ is close to σ₁ anyway, being a mix of the two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _start(n: int, device: torch.device) -> torch.Tensor:
    """A fixed start vector of length n (its own generator: the user's RNG is not drawn from)."""
    g = torch.Generator().manual_seed(n)
    v = torch.randn(n, generator=g, dtype=torch.float32)
    return F.normalize(v, dim=0).to(device)


def spectral_norm_estimate(vectors: dict[str, torch.Tensor], name: str, w: torch.Tensor, iterations: int) -> torch.Tensor:
    """σ̂, a 0-d fp32 tensor on ``w``'s device: ``iterations`` power iterations on the 2-D
    matrix ``w`` (detached), starting from ``vectors[name]`` (a fixed random vector the first
    time, or when ``w``'s shape or device changed), which then holds the next start.

    Args:
        vectors: the kept vectors (one Recorder's, so two Recorders never share a history).
        name: the matrix's name in ``vectors`` (its parameter's).
        w: the matrix.
        iterations: power iterations this call (≥ 1).
    """
    w = w.detach().float()
    v = vectors.get(name)
    if v is None or v.shape[0] != w.shape[1] or v.device != w.device:
        v = _start(w.shape[1], w.device)
    u = F.normalize(w @ v, dim=0)
    for _ in range(iterations - 1):
        v = F.normalize(w.T @ u, dim=0)
        u = F.normalize(w @ v, dim=0)
    wu = w.T @ u
    sigma = wu.norm()
    vectors[name] = F.normalize(wu, dim=0)
    return sigma
