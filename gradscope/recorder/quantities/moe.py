"""The mixture-of-experts quantities (the ``moe`` set, docs/moe.md): routing statistics per
MoE layer and parameter norms per expert.

Routing (from the routers' own outputs, captured in the forward:
:mod:`gradscope.recorder.capture.routers`), one row per MoE layer and recorded step
(``micro_step`` -1, every forward and micro-batch of the step together), at the MoE layer's
``site`` (the router's parent, ``model.layers.0.mlp``). With c_e the token→expert
assignments of expert e (k per token for top-k routing), N the tokens routed and z_t the
router logits of token t:

- ``moe_load``: c_e / Σ_e c_e per expert (``layer_j`` = e): the fraction of the layer's assignments;
- ``moe_imbalance``: max_e c_e / mean_e c_e (1 when balanced, E when one expert takes all);
- ``moe_load_cv``: std_e c_e / mean_e c_e (population std; 0 when balanced);
- ``router_entropy``: (1/N) Σ_t H(softmax(z_t)), nats;
- ``router_z``: (1/N) Σ_t logsumexp(z_t)² (Zoph et al. 2022, ST-MoE, Eq. 5: the router z-loss);
- ``router_topk_mass``: (1/N) Σ_t Σ_{e chosen for t} softmax(z_t)_e: the share of the softmax's
  mass on the experts the router chose;
- ``moe_dropped_frac``: assignments dropped by an expert capacity / all assignments (only
  for routers with an ``expert_capacity``: Switch Transformers).

Under ``torch.distributed`` the counts and sums are added over ranks before any ratio, so
each rank's row is the global value (``across_ranks`` "shared").

Per expert, at site ``<experts module>.<e>`` (``model.layers.0.mlp.experts.3``, ``layer_j`` = e):
``expert_grad_norm`` ‖∂L/∂θ_e‖ and ``expert_param_norm`` ‖θ_e‖ over the expert's parameters,
fused 3-D expert tensors sliced along their first (expert) dimension. The shared expert is
no routed expert: ``param_grad_norm`` has it as a group of its own.
"""

from __future__ import annotations

import weakref

import torch

from gradscope.recorder.discovery.routers import Router, expert_slices, find_routers
from gradscope.recorder.quantities.quantity import Quantity
from gradscope.recorder.quantities.signal_quantities import position
from gradscope.table.keys import Key

PAPER = "Fedus et al. 2022 (Switch); Zoph et al. 2022 (ST-MoE)"


class _Routing(Quantity):
    """Shared parts of the routing statistics: one value per MoE layer from the step's counts."""

    captures, across_ranks, paper = frozenset({"router"}), "shared", PAPER

    def nothing_to_measure(self, layout):
        names = layout.param_groups.get("", ("", None, []))[2]
        if not any(".experts." in n or n.startswith("experts.") for n in names):
            return "the model has no mixture-of-experts layer (no 'experts' module beside a router; docs/moe.md)"
        return None

    def collect(self, ctx):
        capture = ctx.routers
        if capture is None or not capture.routers:
            return
        for i, reason in sorted(capture.unread.items()):
            r = capture.routers[i]
            ctx.warn_once(f"router {r.name} {reason}", f"{self.name}: router {r.name!r} ({type(r.module).__name__}): "
                          f"{reason}; its calls so read have no rows. Not reported again.")
        for r, buf in zip(capture.routers, capture.totals()):
            E = r.num_experts
            counts, (tokens, entropy, z, mass, dropped) = buf[:E], buf[E:].unbind()
            keys, values = self.values(r, counts, tokens, entropy, z, mass, dropped)
            stack, layer = position(ctx.layout, r.block)
            ctx.add_many([Key(-1, stack, layer, r.block, self.name, j, "") for j in keys], values.float())

    def values(self, r: Router, counts, tokens, entropy, z, mass, dropped) -> tuple[list, torch.Tensor]:
        """(layer_j of each row, the values as a 1-d tensor) of one MoE layer."""
        raise NotImplementedError

    def rows(self, data):
        return [row for row in data.collected.get(self.name, []) if row[1] == row[1]]  # (NaN: nothing routed)


def _nan_unless(ok: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return torch.where(ok, value, torch.full_like(value, float("nan")))


class MoeLoad(_Routing):
    """c_e / Σ_e c_e per expert: its share of the MoE layer's assignments (Fedus et al. 2022, f_i of Eq. 4)."""

    name = "moe_load"
    description = "per expert (layer_j), its share of the MoE layer's token→expert assignments in the step"

    def values(self, r, counts, tokens, entropy, z, mass, dropped):
        total = counts.sum()
        return list(range(r.num_experts)), _nan_unless(total > 0, counts / total.clamp_min(1))


class MoeImbalance(_Routing):
    """max_e c_e / mean_e c_e: 1 when balanced, E when one expert takes every assignment."""

    name = "moe_imbalance"
    description = "max over experts of the assignments over their mean (1: balanced; E: one expert takes all)"

    def values(self, r, counts, tokens, entropy, z, mass, dropped):
        mean = counts.mean()
        return [None], _nan_unless(mean > 0, counts.max() / mean.clamp_min(1e-30)).reshape(1)


class MoeLoadCv(_Routing):
    """std_e c_e / mean_e c_e, the population coefficient of variation of the load."""

    name = "moe_load_cv"
    description = "coefficient of variation of the experts' assignments, std/mean (population std; 0: balanced)"

    def values(self, r, counts, tokens, entropy, z, mass, dropped):
        mean = counts.mean()
        std = (counts - mean).square().mean().sqrt()
        return [None], _nan_unless(mean > 0, std / mean.clamp_min(1e-30)).reshape(1)


class _PerToken(_Routing):
    column = ""

    def values(self, r, counts, tokens, entropy, z, mass, dropped):
        total = {"entropy": entropy, "z": z, "mass": mass}[self.column]
        return [None], _nan_unless(tokens > 0, total / tokens.clamp_min(1)).reshape(1)


class RouterEntropy(_PerToken):
    """Mean over routed tokens of H(softmax(z_t)) in nats (log E: uniform; 0: one expert)."""

    name, column = "router_entropy", "entropy"
    description = "mean over routed tokens of the entropy (nats) of softmax(router logits)"


class RouterZ(_PerToken):
    """Mean over routed tokens of logsumexp(z_t)² (Zoph et al. 2022, ST-MoE, Eq. 5)."""

    name, column = "router_z", "z"
    description = "mean over routed tokens of logsumexp(router logits)², the router z-loss term"
    paper = "Zoph et al. 2022 (ST-MoE), Eq. 5"


class RouterTopkMass(_PerToken):
    """Mean over routed tokens of the softmax(z_t) mass on the experts chosen for t."""

    name, column = "router_topk_mass", "mass"
    description = "mean over routed tokens of the softmax(router logits) mass on the experts the router chose"


class MoeDroppedFrac(_Routing):
    """Assignments dropped by an expert capacity over all assignments (routers with an ``expert_capacity``)."""

    name = "moe_dropped_frac"
    description = "share of token→expert assignments dropped by the expert capacity (routers with a capacity only)"

    def values(self, r, counts, tokens, entropy, z, mass, dropped):
        if not r.capacity:
            return [], counts[:0]
        total = counts.sum()
        return [None], _nan_unless(total > 0, dropped / total.clamp_min(1)).reshape(1)


# -- per expert --------------------------------------------------------------------------------
_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its routers with experts (found once)


def _experts(model) -> list[tuple[Router, torch.nn.Module, list[tuple[str, int | None]]]]:
    if model not in _FOUND:
        found = []
        for r in find_routers(model):
            if r.experts is not None:
                experts = model.get_submodule(r.experts)
                found.append((r, experts, expert_slices(experts, r.num_experts)))
        _FOUND[model] = found
    return _FOUND[model]


class _PerExpert(Quantity):
    """‖·‖ over each routed expert's parameters (fused tensors sliced along the expert dimension)."""

    across_ranks, paper = "shared", ""
    nothing_to_measure = _Routing.nothing_to_measure

    def tensor(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        raise NotImplementedError

    def collect(self, ctx):
        for r, experts, slices in _experts(ctx.model):
            E = r.num_experts
            fused, listed = [], [[] for _ in range(E)]  # (E,) squares of fused tensors; 0-d squares per listed expert
            for pname, e in slices:
                t = self.tensor(experts.get_parameter(pname))
                if t is None:
                    continue
                if type(t) not in (torch.Tensor, torch.nn.Parameter):  # (a DTensor: sharded along the experts, not sliced here)
                    ctx.warn_once(f"{self.name} dtensor", f"{self.name}: {r.experts}.{pname} is sharded (a DTensor): "
                                  "no per-expert rows for it")
                    continue
                t = t.detach().float()
                if e is None:
                    fused.append(t.reshape(E, -1).square().sum(dim=1))
                else:
                    listed[e].append(t.square().sum())
            if not fused and not any(listed):
                continue
            device = (fused or [x for xs in listed for x in xs])[0].device
            zero = torch.zeros((), device=device)
            sq = torch.stack([torch.stack(xs).sum() if xs else zero for xs in listed])  # (experts never reached: 0)
            for part in fused:
                sq = sq + part
            stack, layer = position(ctx.layout, r.experts)
            ctx.add_many([Key(-1, stack, layer, f"{r.experts}.{e}", self.name, e, "") for e in range(E)], sq.sqrt())


class ExpertGradNorm(_PerExpert):
    """‖∂L/∂θ_e‖ per routed expert, over its parameters (fused tensors sliced)."""

    name, needs_backward, reads_param_grads = "expert_grad_norm", True, True
    description = "per routed expert e (site: the experts module + '.e', layer_j e), ‖p.grad‖ over its parameters (fused tensors sliced)"

    def tensor(self, p):
        return p.grad


class ExpertParamNorm(_PerExpert):
    """‖θ_e‖ per routed expert, over its parameters (fused tensors sliced)."""

    name = "expert_param_norm"
    description = "per routed expert e (site: the experts module + '.e', layer_j e), ‖θ‖ over its parameters (fused tensors sliced)"

    def tensor(self, p):
        return p


ROUTING = (MoeLoad(), MoeImbalance(), MoeLoadCv(), RouterEntropy(), RouterZ(), RouterTopkMass(), MoeDroppedFrac())
EXPERTS = (ExpertGradNorm(), ExpertParamNorm())
