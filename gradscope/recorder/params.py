"""Parameter-gradient and update norms per group, with one fused norm call.

Groups (SPEC §3 "per layer and per sub-layer, and the global total") come from the layout:
``""`` is the total. A group's norm is sqrt(Σ_p ‖g_p‖²) over its parameters, computed as
``sqrt(M @ sq)`` with M the (groups × params) membership matrix and sq the squared
per-parameter norms from ``torch._foreach_norm`` — no host sync.
"""

from __future__ import annotations

import torch
from torch import nn

from gradscope.recorder.layout import Layout


class ParamGroups:
    """Membership of parameters in the layout's groups.

    Args:
        model: the recorded model.
        layout: provides ``param_groups``.
    """

    def __init__(self, model: nn.Module, layout: Layout) -> None:
        self.names = [n for n, _ in model.named_parameters()]
        self.params = [p for _, p in model.named_parameters()]
        index = {n: i for i, n in enumerate(self.names)}
        self.groups = list(layout.param_groups)
        self.positions = [(layout.param_groups[g][0], layout.param_groups[g][1]) for g in self.groups]
        membership = torch.zeros(len(self.groups), len(self.names))
        for gi, g in enumerate(self.groups):
            for pname in layout.param_groups[g][2]:
                membership[gi, index[pname]] = 1.0
        self._membership = membership
        self._on: dict[torch.device, torch.Tensor] = {}

    def membership(self, device: torch.device) -> torch.Tensor:
        """The (groups × params) 0/1 matrix on ``device`` (cached)."""
        if device not in self._on:
            self._on[device] = self._membership.to(device)
        return self._on[device]

    def squared_norms(self, tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
        """Per-parameter ‖t‖² (0 where t is None), as one float32 vector on the tensors' device."""
        present = [(i, t) for i, t in enumerate(tensors) if t is not None]
        if not present:
            return None
        device = present[0][1].device
        norms = torch._foreach_norm([local(t) for _, t in present])
        sq = torch.zeros(len(tensors), device=device)
        idx = torch.tensor([i for i, _ in present], device=device)
        sq[idx] = torch.stack([n.float() for n in norms]).to(device) ** 2
        return sq

    def group_norms(self, tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
        """sqrt(Σ‖t‖²) per group, a vector in ``self.groups`` order, or None if nothing is present."""
        sq = self.squared_norms(tensors)
        return None if sq is None else (self.membership(sq.device) @ sq).sqrt()

    def grads(self) -> list[torch.Tensor | None]:
        """Current ``p.grad`` of every parameter."""
        return [p.grad for p in self.params]


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
