"""Where the recorder looks: sites, norms, layer-output stacks and parameter groups.

For a zoo model the sites are its :class:`~gradscope.models.sites.Site` modules. For any
other ``nn.Module`` (HuggingFace GPT-2/BERT/T5, x-transformers, ...) the recorder finds the
repeated blocks — every ``nn.ModuleList`` of two or more children of one class — and every
normalisation module (``LayerNorm``, ``RMSNorm``, any class whose name ends in ``Norm``),
and probes their inputs (``<module>.in``) and outputs (``<module>.out``), with no edit to
the model.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass, field

from torch import nn

from gradscope.models.sites import Site, SiteNorm
from gradscope.models.transformer import ZooModel

_ZOO_LAYER = re.compile(r"^(?P<stack>[^.]+)\.layers\.(?P<i>\d+)(\.|$)")


@dataclass(frozen=True)
class Probe:
    """One site: the tensor a module receives (``"input"``) or returns (``"output"``)."""

    name: str
    module: nn.Module
    where: str
    stack: str
    layer: int | None


@dataclass(frozen=True)
class NormProbe:
    """A normalisation module and the site names of its input and output."""

    name: str
    module: nn.Module
    site_in: str
    site_out: str
    stack: str
    layer: int | None


@dataclass(frozen=True)
class StackOutputs:
    """Sites of y_0 (embedding output or first block input) and each layer output y_1..y_L."""

    name: str
    sites: tuple[str, ...]


@dataclass
class Layout:
    """Everything the recorder hooks or reads, found once per model."""

    probes: list[Probe]
    norms: list[NormProbe]
    stacks: list[StackOutputs]
    param_groups: dict[str, tuple[str, int | None, list[str]]]  # group -> (stack, layer, param names)
    mixers: dict[str, nn.Module] = field(default_factory=dict)  # modules with mixing_weights()
    foreign: bool = False

    def site_names(self) -> list[str]:
        """All site names, in module order."""
        return [p.name for p in self.probes]


def is_norm(module: nn.Module) -> bool:
    """LayerNorm, RMSNorm, GroupNorm, or any class whose name ends in 'Norm' (not SiteNorm)."""
    if isinstance(module, SiteNorm):
        return False
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def _zoo_position(name: str) -> tuple[str, int | None]:
    m = _ZOO_LAYER.match(name)
    if m:
        return m["stack"], int(m["i"]) + 1
    stack = name.split(".", 1)[0]
    return (stack, 0) if name.endswith("embed.out") else (stack if stack in ("encoder", "decoder") else "", None)


def _zoo_layout(model: ZooModel) -> Layout:
    probes = []
    for name, module in model.named_modules():
        if isinstance(module, Site):
            probes.append(Probe(name, module, "output", *_zoo_position(name)))
    norms = [
        NormProbe(name, module.inner, f"{name}.in", f"{name}.out", *_zoo_position(name))
        for name, module in model.named_modules()
        if isinstance(module, SiteNorm)
    ]
    stacks, groups = [], {"": ("", None, [])}
    for sname, stack in model.stacks().items():
        L = len(stack.layers)
        stacks.append(StackOutputs(sname, (f"{sname}.embed.out", *(f"{sname}.layers.{i}.out" for i in range(L)))))
        for part in ("embed", "final_norm", "combine"):
            groups[f"{sname}.{part}"] = (sname, 0 if part == "embed" else None, [])
        for i, layer in enumerate(stack.layers):
            groups[f"{sname}.layers.{i}"] = (sname, i + 1, [])
            for sub in layer.sublayer_names:
                groups[f"{sname}.layers.{i}.{sub}"] = (sname, i + 1, [])
    groups["memory"] = ("", None, [])
    mixers = {n: m for n, m in model.named_modules() if hasattr(m, "mixing_weights")}
    return Layout(probes, norms, stacks, _fill_groups(model, groups), mixers)


def _repeated_blocks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(c) for c in module}) == 1:
            if not any(name.startswith(f"{outer}.") for outer, _ in found):
                found.append((name, module))
    return found


def _foreign_layout(model: nn.Module) -> Layout:
    blocks = _repeated_blocks(model)
    block_of = {}
    probes = [Probe(n, m, "output", "", None) for n, m in model.named_modules() if isinstance(m, Site)]
    stacks, groups = [], {"": ("", None, [])}
    for sname, blist in blocks:
        for i, block in enumerate(blist):
            prefix = f"{sname}.{i}"
            block_of[prefix] = (sname, i + 1)
            probes.append(Probe(f"{prefix}.in", block, "input", sname, i + 1))
            probes.append(Probe(f"{prefix}.out", block, "output", sname, i + 1))
            groups[prefix] = (sname, i + 1, [])
            for child, sub in block.named_children():
                if any(True for _ in sub.parameters()):
                    groups[f"{prefix}.{child}"] = (sname, i + 1, [])
        stacks.append(StackOutputs(sname, (f"{sname}.0.in", *(f"{sname}.{i}.out" for i in range(len(blist))))))
    norms = []
    for name, module in model.named_modules():
        if is_norm(module):
            stack, layer = "", None
            for prefix, pos in block_of.items():
                if name.startswith(f"{prefix}."):
                    stack, layer = pos
            probes.append(Probe(f"{name}.in", module, "input", stack, layer))
            probes.append(Probe(f"{name}.out", module, "output", stack, layer))
            norms.append(NormProbe(name, module, f"{name}.in", f"{name}.out", stack, layer))
    if not probes:
        raise ValueError(
            f"{type(model).__name__}: found nothing to record. The recorder looked for gradscope Site modules, "
            "for repeated blocks (an nn.ModuleList of >= 2 children of one class) and for normalisation modules "
            "(nn.LayerNorm, nn.RMSNorm, or a class named *Norm). Name sites by hand by placing "
            "gradscope.Site() modules in your forward (x = self.hook_resid(x)), or pass sites=... to pick modules."
        )
    return Layout(probes, norms, stacks, _fill_groups(model, groups), {}, foreign=True)


def _fill_groups(model: nn.Module, groups: dict) -> dict:
    for pname, _ in model.named_parameters():
        groups[""][2].append(pname)
        for gname, (_, _, members) in groups.items():
            if gname and pname.startswith(f"{gname}."):
                members.append(pname)
    return {g: v for g, v in groups.items() if v[2]}


def find_layout(model: nn.Module, sites: list[str] | None = None) -> Layout:
    """Finds the sites, norms, stacks and parameter groups of ``model``.

    Args:
        model: a zoo model, or any ``nn.Module``.
        sites: optional shell-style (fnmatch) patterns (``"decoder.layers.*.ffn.sum"``; ``*``
            also matches dots, ``?`` one character); only matching
            sites are probed. Norm and cosine quantities need their sites kept.

    Raises:
        ValueError: nothing to record, or a pattern matches no site (the message lists
            some valid names).
    """
    has_sites = any(isinstance(m, Site) for m in model.modules())
    layout = _zoo_layout(model) if isinstance(model, ZooModel) and has_sites else None
    if layout is None:
        layout = _foreign_layout(model)
    if sites is not None:
        names = layout.site_names()
        for pattern in sites:
            if not fnmatch.filter(names, pattern):
                close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.3)
                raise ValueError(
                    f"sites: pattern {pattern!r} matches no site; closest: {close}; valid sites include "
                    f"{names[:4]} ... ({len(names)} in all, list them with gradscope.site_names(model))"
                )
        layout.probes = [p for p in layout.probes if any(fnmatch.fnmatchcase(p.name, pat) for pat in sites)]
    return layout
