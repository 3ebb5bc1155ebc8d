"""The routers' forward hooks and device buffers (the ``moe`` quantities, docs/moe.md).

Each router found by :func:`~gradscope.recorder.discovery.routers.find_routers` gets one
forward hook, armed only while a recorded step runs, that reads the router's own output
(its logits and the experts it chose: nothing is recomputed or re-run) and adds, in place,
into one small device buffer per router, over every forward and micro-batch of the step:

- the token→expert assignments per expert (E counts);
- the tokens routed, Σ over tokens of the entropy of softmax(logits), of logsumexp(logits)²
  (the router z-loss's term, Zoph et al. 2022 ST-MoE Eq. 5) and of the softmax mass of the
  chosen experts;
- for a router with a capacity, the assignments it dropped.

So no value reaches the host before the step's one transfer, and the hook traces under
``torch.compile(fullgraph=True)`` like the rest of the capture. Under ``torch.distributed``
the buffers are summed over ranks once per step (:meth:`RouterCapture.totals`), before any
ratio is taken.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradscope.recorder.capture.hookset import HookSet
from gradscope.recorder.capture.taps import in_backward
from gradscope.recorder.discovery.routers import Router, find_routers

COLUMNS = ("tokens", "entropy", "z", "mass", "dropped")
"""The buffer's columns after the E counts: tokens routed, then sums over them."""


class RouterCapture:
    """Hooks and buffers of the routing statistics; owned by the Capture.

    Args:
        model: the recorded model.
        is_on: whether a recorded step is open (the Capture's flag).
    """

    def __init__(self, model: nn.Module, is_on) -> None:
        self.routers: list[Router] = find_routers(model)
        self.is_on = is_on
        self.want = False
        self.buffers: list[torch.Tensor] = []  # per router (E + 5,) float64: counts, then COLUMNS
        self.unread: dict[int, str] = {}  # router index -> why a call of the step was not read
        self.device: torch.device | None = None
        self._totals: list[torch.Tensor] | None = None

    def install(self, hooks: HookSet) -> None:
        """Registers one forward hook per router in the capture's ``hooks``."""
        for i, r in enumerate(self.routers):
            hooks.forward(r.module, self._hook(i))

    def begin(self, device: torch.device) -> None:
        """Arms the hooks for one recorded step and zeroes the buffers."""
        if self.device != device or len(self.buffers) != len(self.routers):
            self.device = device
            dtype = torch.float32 if device.type == "mps" else torch.float64  # (counts exact past 2^24 assignments)
            self.buffers = [torch.zeros(r.num_experts + len(COLUMNS), device=device, dtype=dtype) for r in self.routers]
        for b in self.buffers:
            b.zero_()
        self.unread, self._totals, self.want = {}, None, True

    def end(self) -> None:
        self.want = False

    def remove(self) -> None:
        self.buffers, self._totals = [], None

    def totals(self) -> list[torch.Tensor]:
        """The step's buffers, summed over ranks under ``torch.distributed`` (one
        ``all_reduce`` for all routers, once per step: every rank must record the step)."""
        if self._totals is None:
            self._totals = self.buffers
            if self.buffers and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                flat = torch.cat(self.buffers)
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                self._totals = list(flat.split([b.numel() for b in self.buffers]))
        return self._totals

    # -- the hook ---------------------------------------------------------------------------
    def _hook(self, i: int):
        r = self.routers[i]

        def hook(module, args, kwargs, output):
            if not (self.want and self.is_on()) or in_backward():
                return None
            read = router_output(r, output)
            if isinstance(read, str):
                self.unread[i] = read
                return None
            logits, chosen, dispatch = read
            add_routing(self.buffers[i], logits, chosen, dispatch, r.num_experts)
            return None

        return hook


def router_output(r: Router, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | str:
    """(logits (N, E), chosen experts (N, k), dispatch mask (N, E) or None) from what router
    ``r`` returned, all detached; or why it cannot be read."""
    E = r.num_experts
    items = list(output) if isinstance(output, (tuple, list)) else [output]
    tensors = [t for t in items if isinstance(t, torch.Tensor)]
    wide = [t for t in tensors if t.is_floating_point() and t.dim() >= 1 and t.shape[-1] == E]
    if not wide:
        return f"its output holds no floating tensor of {E} router logits in its last dimension"
    if r.capacity and len(wide) != 1:  # (NLLB-MoE: top-2 with a capacity, its combine weights beside its logits)
        return ("it has an expert_capacity but its output is not Switch Transformers' (a dispatch mask, the top-1 "
                "probability and the logits): which of its tensors are the logits and the dispatch is not known")
    logits = wide[0]
    logits = logits.detach().reshape(-1, E).float()
    ints = [t for t in tensors if not t.is_floating_point() and t.dim() >= 1 and t.dtype != torch.bool]
    dispatch = None
    if r.capacity:
        mask = next((t for t in ints if t.shape[-1] == E), None)
        if mask is None:
            return f"it has an expert_capacity but its output holds no (..., {E}) dispatch mask"
        dispatch = mask.detach().reshape(-1, E)
        chosen = logits.argmax(dim=-1, keepdim=True)  # (top-1 before the capacity: the router's own choice)
    elif ints:
        chosen = ints[-1].detach().reshape(logits.shape[0], -1)
    elif r.top_k is not None:
        chosen = logits.topk(r.top_k, dim=-1).indices  # (a router returning logits alone: softmax top-k)
    else:
        return "it returns logits only and neither it nor its MoE layer has a top_k (or num_experts_per_tok)"
    return logits, chosen, dispatch


def add_routing(buf: torch.Tensor, logits: torch.Tensor, chosen: torch.Tensor, dispatch: torch.Tensor | None,
                E: int) -> None:
    """Adds one router call's statistics into ``buf`` in place (layout: module docstring)."""
    logp = F.log_softmax(logits, dim=-1)  # (N, E)
    p = logp.exp()
    entropy = -(p * logp).sum(dim=-1)  # (N,)
    lse = torch.logsumexp(logits, dim=-1)  # (N,)
    mass = p.gather(1, chosen).sum(dim=-1)  # (N,)
    flat = chosen.reshape(-1)
    buf.index_add_(0, flat, torch.ones_like(flat, dtype=buf.dtype))
    n = logits.shape[0]
    stats = torch.stack([entropy.sum(), lse.square().sum(), mass.sum()]).to(buf.dtype)
    buf[E] += n
    buf[E + 1: E + 4] += stats
    if dispatch is not None:
        buf[E + 4] += flat.numel() - dispatch.sum().to(buf.dtype)
