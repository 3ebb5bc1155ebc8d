"""How each site of a layout is captured: decided once, when the Recorder is made.

A site's value and gradient can be read in several ways (see :mod:`gradscope.recorder.capture.capture`
and :mod:`gradscope.recorder.capture.eager`); which one is exact depends on where the site is (a
module's output or input, a norm's input) and on what the model promises. :func:`plan_sites`
makes that choice for every site, so the hooks only look their site's choice up.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

from torch import nn

from gradscope.models.sites import Site
from gradscope.recorder.discovery.module_class import own_class
from gradscope.recorder.discovery.layout import Layout
from gradscope.recorder.numerics.norm_stats import norm_kind


class SitePlan(NamedTuple):
    """Per site (``layout.sites`` order) and per norm (``layout.norms`` order), how capture reads it.

    Attributes:
        norm_kind: per norm, its kind (:func:`gradscope.recorder.numerics.norm_stats.norm_kind`).
        norm_in: per norm, the index of the site whose gradient it gives (its input), or None.
        taps: per site, whether its value passes through a tap (a ``Tap``, a node hook or an alias).
        hooked: per site, whether its gradient may be read eagerly by a pre-hook on the node that
            made it (a module's own output).
        alias: per site, whether an alias stands in for the Tap eagerly (no in-place op can follow).
        promised: the model promises that no Site output is modified in place.
        quick: per site, whether its eager statistics take the short path (``Capture._observe_eagerly``).
        grad_expected: per site, whether its gradient arrives (by its own tap or a norm's).
    """

    norm_kind: list[str | None]
    norm_in: list[int | None]
    taps: list[bool]
    hooked: list[bool]
    alias: list[bool]
    promised: bool
    quick: list[bool]
    grad_expected: list[bool]


def plan_sites(model: nn.Module, layout: Layout) -> SitePlan:
    """How every site of ``layout`` in ``model`` is captured (see :class:`SitePlan`)."""
    sites = list(layout.sites)
    index = {p.name: i for i, p in enumerate(sites)}
    kinds = [norm_kind(n.module) for n in layout.norms]
    norm_in = [index.get(n.site_in) for n in layout.norms]
    # A norm's input is tapped only when the norm is one fused op that reads it once
    # (nn.LayerNorm): the tap then passes on exactly the one gradient autograd would add.
    # Other norms use their input twice (x·rsqrt(mean x²)); a tap would sum those two
    # contributions before the residual's, changing training in the last bit, so their
    # gradient comes from the tap on their output (NormTap, closed form).
    norm_inputs = {n.site_in for n in layout.norms}
    fused = {n.site_in for n, k in zip(layout.norms, kinds) if k == "ln"}
    by_output = {n.site_in for n, k in zip(layout.norms, kinds) if k not in (None, "ln")}
    taps = [p.name not in norm_inputs or p.name in fused for p in sites]
    # Eagerly, a module's output may be read more cheaply by a node hook (recorder/capture/eager.py).
    # Not a norm's input, which wants the gradient through the norm alone, and not a
    # module's input, which wants the gradient through that module alone.
    outputs = [p.where == "output" and p.name not in norm_inputs for p in sites]
    hooked = [o and not isinstance(p.module, Site) for o, p in zip(outputs, sites)]  # a Site returns its input
    promised = bool(getattr(model, "site_outputs_never_modified_in_place", False))
    # Where no in-place op can follow, an alias (a C++ node of its own) stands in for the Tap:
    # the outputs of a promising model's Sites, and the input of a fused norm that only the
    # norm reads: a SiteNorm's ``in`` Site (the zoo) or what nn.LayerNorm itself receives
    # (its forward modifies nothing in place). The alias's node then sees exactly the
    # gradient the Tap would, through that norm alone.
    plain_ln = {n.site_in for n in layout.norms if own_class(n.module).forward is nn.LayerNorm.forward}
    # Not at outputs under FSDP2: fully_shard hooks a wrapped module's output tensors for its
    # backward and warns of a view there (an in-place op on it would drop that hook), and an
    # alias is a view; the Tap's output is none.
    outputs_alias = promised and not fully_sharded(model)
    alias = [(o and outputs_alias) or (p.name in fused and (outputs_alias if p.where == "output" else p.name in plain_ln))
             for o, p in zip(outputs, sites)]
    # Sites whose eager statistics take the short path: a promising model's value waits to be
    # reduced with the others, and its gradient comes through an alias that keeps it
    quick = [promised and a and not h for a, h in zip(alias, hooked)]
    grad_expected = [p.name not in norm_inputs or p.name in fused | by_output for p in sites]
    return SitePlan(kinds, norm_in, taps, hooked, alias, promised, quick, grad_expected)


def fully_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) wrapped ``model`` or a module in it (read from
    ``torch.distributed.fsdp`` only if something imported it already)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    wrapped = getattr(fsdp, "FSDPModule", None)
    return wrapped is not None and any(isinstance(m, wrapped) for m in model.modules())
