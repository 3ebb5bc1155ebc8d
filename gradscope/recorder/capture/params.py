"""Parameter-gradient and update norms per group, with one fused norm call.

Groups (per layer and per sub-layer, and the global total: docs/table.md) come from the layout:
``""`` is the total. A group's norm is sqrt(Σ_p ‖g_p‖²) over its parameters, computed as
``sqrt(M @ sq)`` with M the (groups × params) membership matrix and sq the squared
per-parameter norms (:func:`gradscope.recorder.numerics.squared_norms.squared_norms`) — no host sync.

Under FSDP2 (or any DTensor parameters) a gradient's ``to_local()`` is this rank's shard,
so the squared shard norms are summed across the device mesh with one ``all_reduce`` per
call (see :func:`gradscope.distributed.reduce_squared_norms`); every rank then holds the
global norms. Plain tensors (single process, DDP after its all-reduce) are used as they are.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gradscope.recorder.numerics import squared_norms as sqnorm
from gradscope.recorder.discovery.layout import Layout
from gradscope.table.keys import Key


class ParamGroups:
    """Membership of parameters in the layout's groups.

    Args:
        model: the recorded model.
        layout: provides ``param_groups``.
    """

    def __init__(self, model: nn.Module, layout: Layout) -> None:
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]
        index = {n: i for i, n in enumerate(self.names)}
        first = {id(p): index[n] for n, p in model.named_parameters()}
        for alias, p in model.named_parameters(remove_duplicate=False):  # a shared parameter under each name
            index.setdefault(alias, first[id(p)])
        self.groups = list(layout.param_groups)
        self.positions = [(layout.param_groups[g][0], layout.param_groups[g][1]) for g in self.groups]
        self.roles = [layout.group_roles.get(g, "") for g in self.groups]  # embedding, head, final_norm, other or ""
        membership = torch.zeros(len(self.groups), len(self.names))
        for gi, g in enumerate(self.groups):
            for pname in layout.param_groups[g][2]:
                membership[gi, index[pname]] = 1.0
        self._membership = membership
        self._membership_np = membership.numpy().astype(np.float64)
        self.populated = (self._membership_np.sum(axis=1) > 0).tolist()  # per group: has a parameter
        self._on: dict[torch.device, torch.Tensor] = {}
        self._keys: dict[str, list[Key]] = {}
        # the plan of the parameters' gradients, and which parameters had none (squared_norms)
        self._plan: tuple[sqnorm.SquaredNormPlan | None, list[int] | None] = (None, None)

    def keys(self, quantity: str) -> list[Key]:
        """Row keys of ``quantity`` for every group, in ``self.groups`` order (made once per quantity)."""
        keys = self._keys.get(quantity)
        if keys is None:
            keys = self._keys[quantity] = [Key(-1, s, lay, g, quantity, None, r)
                                           for g, (s, lay), r in zip(self.groups, self.positions, self.roles)]
        return list(keys)

    @property
    def params(self) -> list[nn.Parameter]:
        """The model's parameters now, in ``self.names`` order.

        Read live (``fully_shard`` replaces parameter objects, and a module swapped in after
        the recorder was built brings new ones), through a cached map of where each
        parameter lives that is checked, cheaply, against the module tree on every read. A
        model whose parameter names changed (parameters added, removed or newly tied)
        cannot be mapped to the groups found at construction, and raises.
        """
        cache = getattr(self, "_where", None)
        if cache is not None:  # each check one C-level map over dicts the modules keep
            (child_dicts, child_names, children), (param_dicts, counts), (slot_dicts, slot_names) = cache
            if (list(map(dict.get, child_dicts, child_names)) == children
                    and list(map(len, param_dicts)) == counts):
                params = list(map(dict.get, slot_dicts, slot_names))
                # the very parameters of the last read (distinct then, so none is None or tied now;
                # one pass of `is`, 6 µs), else none missing and none twice (`in` would compare
                # tensors elementwise)
                if all(map(operator.is_, params, self._last)) or (
                        not any(map(operator.is_, params, itertools.repeat(None))) and len(set(map(id, params))) == len(params)):
                    self._last = params
                    return params
        return self._walk()

    def device(self) -> torch.device:
        """The device of the model's first parameter (the CPU without parameters): where the
        last read of :attr:`params` found it (one dict lookup; ``model.parameters()`` walks
        generators through the module tree, ≈ 20 µs a step at d=16), else from the model."""
        cache = getattr(self, "_where", None)
        if cache is not None and cache[2][0]:
            p = cache[2][0][0].get(cache[2][1][0])
            if p is not None:
                return p.device
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def _walk(self) -> list[nn.Parameter]:
        named = list(self.model.named_parameters())
        if len(named) != len(self.names) or any(n != want for (n, _), want in zip(named, self.names)):
            now = [n for n, _ in named]
            diff = next((f"{a!r} vs {b!r}" for a, b in zip(now, self.names) if a != b), "a different count")
            raise RuntimeError(
                f"Recorder: the model's parameters changed since the Recorder was built ({len(now)} now, "
                f"{len(self.names)} then; first difference: {diff}); build a new Recorder after changing the model"
            )
        modules = list(self.model.modules())
        tree = [(parent._modules, n, child) for parent in modules for n, child in parent._modules.items() if child is not None]
        slots = []
        for name, _ in named:
            owner, _, attr = name.rpartition(".")
            slots.append((self.model.get_submodule(owner)._parameters, attr))
        self._where = ([d for d, _, _ in tree], [n for _, n, _ in tree], [c for _, _, c in tree]), \
            ([m._parameters for m in modules], [len(m._parameters) for m in modules]), \
            ([d for d, _ in slots], [n for _, n in slots])
        self._last = [p for _, p in named]
        return list(self._last)

    def membership(self, device: torch.device) -> torch.Tensor:
        """The (groups × params) 0/1 matrix on ``device`` (cached)."""
        if device not in self._on:
            self._on[device] = self._membership.to(device)
        return self._on[device]

    def squared_norms(self, tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
        """Per-parameter ‖t‖² (0 where t is None), as one float32 vector on the tensors' device."""
        present = [t for t in tensors if t is not None]
        if not present:
            return None
        sharded = not set(map(type, present)) <= _PLAIN and any(is_dtensor(t) for t in present)
        missing = None if len(present) == len(tensors) else [i for i, t in enumerate(tensors) if t is None]
        # the plan the gradients took last, if the same parameters have one now (a plan reads
        # the tensors by their place in ``present``, and their shapes are the parameters')
        plan, planned_missing = self._plan
        stacked = plan.if_joined(present) if plan is not None and missing == planned_missing and not sharded else None
        if stacked is None:
            stacked = sqnorm.fp64_squared_norms([local(t) for t in present] if sharded else present)
            self._plan = (None if sharded else sqnorm.plan_for(present), missing)
        stacked = stacked.float()
        device = stacked.device
        if len(present) == len(tensors):
            sq = stacked
        else:
            sq = torch.zeros(len(tensors), device=device)
            sq[torch.tensor([i for i, t in enumerate(tensors) if t is not None], device=device)] = stacked
        if sharded:
            from gradscope.recorder.numerics.collectives import reduce_squared_norms

            sq = reduce_squared_norms(tensors, sq)
        return sq

    def group_norms(self, tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
        """sqrt(Σ‖t‖²) per group, a vector in ``self.groups`` order, or None if nothing is present."""
        sq = self.squared_norms(tensors)
        return None if sq is None else (self.membership(sq.device) @ sq).sqrt()

    def host_sums(self, values: np.ndarray) -> np.ndarray:
        """Per group, the sum of its member parameters' ``values`` (``self.params`` order), on the host."""
        return self._membership_np @ np.asarray(values, dtype=np.float64)

    def any_member(self, flags: list[bool]) -> list[bool]:
        """Per group: whether any member parameter's flag (``self.params`` order) is set."""
        hit = np.asarray(flags, dtype=np.float64)  # host flags: no tensor is read
        return ((self._membership_np @ hit) > 0).tolist()

    def grads(self) -> list[torch.Tensor | None]:
        """Current ``p.grad`` of every parameter."""
        return [p.grad for p in self.params]


_PLAIN = {torch.Tensor, nn.Parameter}  # types that are no DTensor, checked as a set


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (duck-typed, so ``torch.distributed.tensor`` is never imported here)."""
    if type(t) in (torch.Tensor, nn.Parameter):
        return False
    return callable(getattr(t, "to_local", None)) and hasattr(t, "placements")


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, the tensor itself otherwise.

    A DTensor with a ``Partial`` placement (pending sums, as tensor parallelism can leave
    on gradients) is first redistributed to ``Replicate`` there (a collective for that
    tensor), since the norm of a sum is not the sum of norms.
    """
    if not is_dtensor(t):
        return t
    if any(p.is_partial() for p in t.placements):
        from torch.distributed.tensor import Replicate

        t = t.redistribute(placements=[Replicate() if p.is_partial() else p for p in t.placements])
    return t.to_local()


@dataclass
class GradsSeen:
    """The parameters' gradients at one moment (:func:`grads_seen`), to tell later whether a
    backward changed one (:meth:`changed`) without walking the module tree again."""

    params: list[nn.Parameter]
    grads: list[torch.Tensor | None]
    versions: list[int | None] | None  # None: every gradient was None (the usual start of a step)

    def changed(self) -> bool:
        """Whether a gradient is another tensor now, or the same one written since."""
        now = list(map(_GRAD, self.params))
        if self.versions is None:
            return any(map(operator.is_not, now, itertools.repeat(None)))
        return (not all(map(operator.is_, now, self.grads))
                or [None if g is None else g._version for g in now] != self.versions)


def grads_seen(params: list[nn.Parameter]) -> GradsSeen:
    """The gradients of ``params`` now (≈ 0.3 µs a parameter; a walk of the module tree, as
    ``model.parameters()`` does, costs ≈ 1 ms at d=16 with 534 modules)."""
    grads = list(map(_GRAD, params))
    none = not any(map(operator.is_not, grads, itertools.repeat(None)))
    return GradsSeen(params, grads, None if none else [None if g is None else g._version for g in grads])


_GRAD = operator.attrgetter("grad")
