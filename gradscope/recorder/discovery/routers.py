"""Mixture-of-experts routers and their experts, found in any model (the ``moe`` quantities,
:mod:`gradscope.recorder.quantities.moe`).

A module is a **router** when

- its class name contains ``Router`` and it holds parameters (HuggingFace transformers 5:
  ``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter``, ``OlmoeTopKRouter``,
  ``DeepseekV3TopkRouter``, ``GptOssTopKRouter``, ``SwitchTransformersTop1Router``, ...), or
- it is a child named ``gate`` or ``router`` of a module that also has a child named
  ``experts`` (an ``nn.Linear`` gate beside its experts, as older or hand-written MoE
  layers have it), or
- it declares itself: ``gradscope_router = True`` on its class or instance (a router of
  one's own model whose name says nothing; see docs/moe.md).

What a router's forward returns is read by its hook (:mod:`gradscope.recorder.capture.routers`):
the router logits (..., E) alone, or a tuple holding them (the first floating tensor whose
last dimension is E) and the chosen experts' indices (the last integer tensor). A router
with an ``expert_capacity`` attribute returns, in place of indices, a (..., E) dispatch mask
with the tokens beyond an expert's capacity zeroed (Switch Transformers).

Its **experts** are the sibling named ``experts``: fused 3-D expert tensors (a parameter of
that module whose first dimension is E: ``gate_up_proj`` (E, ·, ·) in transformers 5) are
sliced along the expert dimension; a list of E expert modules gives one expert per entry.
A shared expert (``shared_expert``, ``shared_experts``) is no routed expert: it is a
parameter group of its own (:func:`~gradscope.recorder.discovery.param_grouping.block_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

ROUTER_NAMES = ("gate", "router")
"""Names a router takes beside an ``experts`` child when its class does not say it is one."""

TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "k", "topk")
"""Attributes, on the router or its MoE block, that give how many experts a token chooses."""


@dataclass(frozen=True)
class Router:
    """One router of a mixture-of-experts layer.

    Attributes:
        name: the router module's name (``model.layers.0.mlp.gate``).
        module: the router module.
        block: the MoE layer's name, the router's parent (``model.layers.0.mlp``): the
            ``site`` of the routing rows.
        num_experts: E, the routed experts.
        top_k: experts chosen per token when the router returns only logits (None: unknown,
            then its indices must come with its output).
        capacity: it has an ``expert_capacity``: its output carries a dispatch mask.
        experts: the name of its experts module, or None when it has none beside it.
    """

    name: str
    module: nn.Module
    block: str
    num_experts: int
    top_k: int | None
    capacity: bool
    experts: str | None


def find_routers(model: nn.Module) -> list[Router]:
    """Every router of ``model`` (module docstring for the rules), in module order.

    Raises:
        ValueError: a router whose number of experts cannot be found (no ``num_experts``
            attribute on it or its MoE layer, and no weight of E rows): the message names it.
    """
    modules = dict(model.named_modules())
    out: list[Router] = []
    taken: list[str] = []
    for name, module in modules.items():
        if not name or any(name.startswith(f"{t}.") for t in taken):
            continue  # (a router's own parts, as Switch's classifier, are no routers)
        parent_name = name.rpartition(".")[0]
        parent = modules[parent_name]
        if not _is_router(name, module, parent):
            continue
        experts = f"{parent_name}.experts" if parent_name else "experts"
        experts = experts if isinstance(getattr(parent, "experts", None), nn.Module) else None
        E = _num_experts(module, parent, experts and modules[experts])
        if E is None:
            raise ValueError(f"router {name!r} ({type(module).__name__}): its number of experts is not known; give it "
                             "(or its MoE layer) a num_experts attribute")
        top_k = next((int(v) for m in (module, parent) for a in TOP_K_ATTRS
                      if isinstance(v := getattr(m, a, None), int) and not isinstance(v, bool)), None)
        capacity = getattr(module, "expert_capacity", None) is not None
        out.append(Router(name, module, parent_name, E, top_k, capacity, experts))
        taken.append(name)
    return out


def _is_router(name: str, module: nn.Module, parent: nn.Module) -> bool:
    if getattr(module, "gradscope_router", False) is True:
        return True
    if next(module.parameters(), None) is None:
        return False
    if "Router" in type(module).__name__:
        return True
    return name.rpartition(".")[2] in ROUTER_NAMES and isinstance(getattr(parent, "experts", None), nn.Module)


def _num_experts(router: nn.Module, parent: nn.Module, experts: nn.Module | None) -> int | None:
    for m in (router, parent, experts):
        for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
            v = getattr(m, attr, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    if isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
        return len(experts)
    linear = router if isinstance(router, nn.Linear) else next((m for m in router.modules() if isinstance(m, nn.Linear)), None)
    if linear is not None:
        return linear.out_features
    weight = getattr(router, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, nn.Parameter) and weight.dim() == 2 else None


def expert_slices(experts: nn.Module, num_experts: int) -> list[tuple[str, int | None]]:
    """How each of ``experts``' parameters splits into experts: (parameter name relative to
    ``experts``, its expert, or None for a fused tensor sliced along its first dimension).

    A list of E expert modules: each entry's parameters belong to that expert. Fused
    tensors: the parameters of ``experts`` itself whose first dimension is E (a parameter of
    another shape belongs to no expert and is left out).
    """
    if isinstance(experts, (nn.ModuleList, nn.ModuleDict)) and len(experts) == num_experts:
        return [(f"{k}.{p}", e) for e, (k, entry) in enumerate(experts.named_children())
                for p, _ in entry.named_parameters()]
    return [(p, None) for p, t in experts.named_parameters() if t.dim() >= 1 and t.shape[0] == num_experts]
