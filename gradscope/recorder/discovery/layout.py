"""Where the recorder looks: sites and their roles, norms, layer-output stacks, parameter groups.

Found once per model. A zoo model (anything holding :class:`~gradscope.models.sites.Site`
modules and offering ``stacks()``) is recorded at its sites. Any other ``nn.Module``
(HuggingFace, x-transformers, nanoGPT, ``nn.Transformer``...) is read by what its modules
are, never by running them:

- **Repeated blocks**: an ``nn.ModuleList``/``nn.Sequential`` of two or more children of
  one class that hold parameters. A child that is itself a container (x-transformers keeps
  each layer as ``ModuleList([norms, block, residual])``) stands for its parameter-richest
  callable child (``layers.3.1``). Sites ``<block>.in`` (role ``layer_in``) and
  ``<block>.out`` (role ``layer_out``). The blocks also form a
  layer-output stack for ``cosine`` when they are of one class; a stack whose outputs
  change width (a convolutional feature encoder) gets no cosine rows.
- **Norms**: ``nn.LayerNorm``, ``nn.RMSNorm``, group/batch/instance norms, gradscope's
  ``ScaleNorm``, and any *leaf* module whose class name ends in ``Norm`` and whose own
  parameters are at most 1-D (``LlamaRMSNorm``, ``T5LayerNorm``). So a whole encoder layer
  named ``...StableLayerNorm`` or a weight-norm parametrization is not a norm. Sites
  ``<norm>.in`` (role ``norm_in``) and ``<norm>.out`` (role ``norm_out``).

Every site is a module boundary, and the gradient recorded there is the gradient of the
value that crosses it: at ``<norm>.in`` the gradient that flows back through the norm alone
(so ``ln_gain`` = ‖norm_in‖ / ‖norm_out‖ for zoo and foreign models alike), at a block
output everything downstream of it.
"""

from __future__ import annotations

import dataclasses

import difflib
import fnmatch
import re
import warnings
from dataclasses import dataclass, field

from torch import nn

from gradscope.models.sites import Site, SiteNorm
from gradscope.recorder.discovery.module_class import own_class
from gradscope.recorder.discovery.norm_modules import KNOWN_NORMS, is_norm, wraps_a_bare_norm  # noqa: F401  (re-exported)
from gradscope.recorder.discovery.param_grouping import CONTAINERS, block_groups, fill_groups, outside_groups
from gradscope.table import ROLES, ZOO_SUFFIX_ROLES  # noqa: F401  (ROLES re-exported: what a site can be)
from gradscope.user_frames import user_stacklevel

_ZOO_LAYER = re.compile(r"^(?P<stack>[^.]+)\.layers\.(?P<i>\d+)(\.|$)")


@dataclass(frozen=True)
class RecordedSite:
    """One site: the tensor a module receives (``where="input"``) or returns (``"output"``)."""

    name: str
    module: nn.Module
    where: str
    stack: str
    layer: int | None
    role: str = "other"


@dataclass(frozen=True)
class RecordedNorm:
    """A normalisation module and the names of the sites on its input and output."""

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
    width: int | None = None  # feature width of those outputs, when known before a forward


@dataclass
class Layout:
    """Everything the recorder hooks or reads, found once per model."""

    sites: list[RecordedSite]
    norms: list[RecordedNorm]
    stacks: list[StackOutputs]
    param_groups: dict[str, tuple[str, int | None, list[str]]]  # group -> (stack, layer, parameter names)
    mixers: dict[str, nn.Module] = field(default_factory=dict)  # modules offering mixing_weights()
    foreign: bool = False
    group_roles: dict[str, str] = field(default_factory=dict)  # group -> PARAM_ROLES entry ("" when absent)
    not_norms: list[str] = field(default_factory=list)  # *Norm modules left out (parameters of more than one dimension)

    def warn_not_norms(self) -> None:
        """Warns (at the user's line) of the *Norm modules left out as norms, if any."""
        if self.not_norms:
            warnings.warn(f"gradscope: {self.not_norms[:4]}{' ...' if len(self.not_norms) > 4 else ''} "
                          "are named *Norm but hold parameters of more than one dimension (a per-head gain, as "
                          "Cohere's q/k norms), which the recorder does not read as a norm: they have no norm sites, "
                          "ln_gain or w/sigma rows", stacklevel=user_stacklevel())

    def site_names(self) -> list[str]:
        """All site names, in module order."""
        return [p.name for p in self.sites]

    def role_of(self) -> dict[str, str]:
        """Site name -> role."""
        return {p.name: p.role for p in self.sites}


def is_zoo(model: nn.Module) -> bool:
    """A model that offers ``stacks()`` and holds gradscope ``Site`` modules."""
    return callable(getattr(model, "stacks", None)) and any(isinstance(m, Site) for m in model.modules())


# -- zoo ------------------------------------------------------------------------------------
def _zoo_position(name: str) -> tuple[str, int | None]:
    m = _ZOO_LAYER.match(name)
    if m:
        return m["stack"], int(m["i"]) + 1
    stack = name.split(".", 1)[0]
    return (stack, 0) if name.endswith("embed.out") else (stack if stack in ("encoder", "decoder") else "", None)


def _zoo_role(name: str) -> str:
    if re.search(r"\.layers\.\d+\.in$", name):
        return "layer_in"
    if re.search(r"\.layers\.\d+\.out$", name):
        return "layer_out"
    if name.startswith("memory."):
        return "memory"
    return next((role for suffix, role in ZOO_SUFFIX_ROLES if name.endswith(suffix)), "other")


def _zoo_layout(model: nn.Module) -> Layout:
    norm_sites = {}  # the in/out sites of every SiteNorm are norm sites, wherever they sit
    for name, module in model.named_modules():
        if isinstance(module, SiteNorm):
            final = name.endswith("final_norm")
            norm_sites[f"{name}.in"] = "final_norm_in" if final else "norm_in"
            norm_sites[f"{name}.out"] = "final_norm_out" if final else "norm_out"
    recorded = [
        RecordedSite(name, module, "output", *_zoo_position(name), norm_sites.get(name) or _zoo_role(name))
        for name, module in model.named_modules() if isinstance(module, Site)
    ]
    norms = [
        RecordedNorm(name, module.inner, f"{name}.in", f"{name}.out", *_zoo_position(name))
        for name, module in model.named_modules() if isinstance(module, SiteNorm)
    ]
    width = getattr(getattr(model, "config", None), "d_model", None)
    stacks, groups = [], {"": ("", None, [])}
    for sname, stack in model.stacks().items():
        L = len(stack.layers)
        stacks.append(StackOutputs(sname, (f"{sname}.embed.out", *(f"{sname}.layers.{i}.out" for i in range(L))), width))
        for part in ("embed", "final_norm", "combine"):
            groups[f"{sname}.{part}"] = (sname, 0 if part == "embed" else None, [])
        for i, layer in enumerate(stack.layers):
            groups[f"{sname}.layers.{i}"] = (sname, i + 1, [])
            for sub in layer.sublayer_names:
                groups[f"{sname}.layers.{i}.{sub}"] = (sname, i + 1, [])
    groups["memory"] = ("", None, [])
    mixers = {n: m for n, m in model.named_modules() if callable(getattr(m, "mixing_weights", None))}
    roles = {g: "embedding" if g.endswith(".embed") else "final_norm" for g in groups if g.endswith((".embed", ".final_norm"))}
    return Layout(recorded, norms, stacks, fill_groups(model, groups), mixers, group_roles=roles)


# -- foreign models -----------------------------------------------------------------------
def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _block_in(child: nn.Module | None) -> tuple[str, nn.Module] | None:
    """(suffix, block) for one entry of a layer list; a container entry stands for its
    parameter-richest callable child."""
    if child is None or not _has_params(child):
        return None
    if not isinstance(child, CONTAINERS):
        return "", child
    inner = [(n, c) for n, c in child.named_children() if not isinstance(c, CONTAINERS) and _has_params(c)]
    if not inner:
        return None
    name, block = max(inner, key=lambda nc: sum(p.numel() for p in nc[1].parameters()))
    return f".{name}", block


def _repeated_blocks(model: nn.Module) -> list[tuple[str, list[tuple[str, nn.Module]], bool]]:
    """(list path, [(site prefix, block)], blocks of one class) for every layer list found. A
    block the list holds more than once (weights shared across depth: ``[block] * 3``) is
    one layer at its first place, whose later calls are rows ``#2``, ``#3`` of its sites."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        if any(name.startswith(f"{outer}.") for outer, _, _ in found):
            continue
        entries = [_block_in(child) for child in module]
        if any(e is None for e in entries):
            continue
        children = list(module)
        same_entry_class = len({own_class(c) for c in children}) == 1
        if not same_entry_class:
            continue
        blocks, seen = [], set()
        for i, (suffix, block) in enumerate(entries):
            if id(block) not in seen:  # (a list that holds one block twice, [block] * 3: its first place, called again)
                seen.add(id(block))
                blocks.append((f"{name}.{i}{suffix}" if name else f"{i}{suffix}", block))
        found.append((name, blocks, len({own_class(b) for _, b in blocks}) == 1))
    return found


def block_width(block: nn.Module) -> int | None:
    """Feature width of a block's output, read from the widest norm inside it (the residual
    stream's: Qwen3's per-head ``q_norm``/``k_norm`` are narrower): its ``normalized_shape``,
    else its 1-D gain whatever its name (``weight``, ``scale``, ``g``, ``gamma``); for a block
    whose norms have neither, the output width of its last ``nn.Linear``."""
    widths = []
    for name, m in block.named_modules():
        if is_norm(m, name):
            shape = getattr(m, "normalized_shape", None)
            gains = [p for p in m.parameters(recurse=False) if p.dim() == 1 and p.numel() > 1]  # not a scalar g
            if shape:
                widths.append(int(shape[-1]))
            elif gains:
                widths.append(int(gains[0].shape[0]))
    if widths:
        return max(widths)
    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    return linears[-1].out_features if linears else None


def _foreign_layout(model: nn.Module) -> Layout:
    recorded = [RecordedSite(n, m, "output", "", None, "other") for n, m in model.named_modules() if isinstance(m, Site)]
    stacks, groups, position = [], {"": ("", None, [])}, {}
    for sname, blocks, one_class in _repeated_blocks(model):
        for i, (prefix, block) in enumerate(blocks):
            position[prefix] = (sname, i + 1)
            recorded.append(RecordedSite(f"{prefix}.in", block, "input", sname, i + 1, "layer_in"))
            recorded.append(RecordedSite(f"{prefix}.out", block, "output", sname, i + 1, "layer_out"))
            groups[prefix] = (sname, i + 1, [])
            for group in block_groups(prefix, block):  # its sub-layers (param_grouping.py)
                groups[group] = (sname, i + 1, [])
        if one_class:  # a cosine stack; outputs of another width are skipped when they arrive
            names = (f"{blocks[0][0]}.in", *(f"{p}.out" for p, _ in blocks))
            stacks.append(StackOutputs(sname, names, block_width(blocks[0][1])))
    norms = []
    modules = dict(model.named_modules())
    for name, module in modules.items():
        parent = modules.get(name.rpartition(".")[0]) if name else None
        if not is_norm(module, name) or (parent is not None and parent is not module and wraps_a_bare_norm(parent)):
            continue
        stack, layer = "", None
        for prefix, pos in position.items():
            if name.startswith(f"{prefix}."):
                stack, layer = pos
        recorded.append(RecordedSite(f"{name}.in", module, "input", stack, layer, "norm_in"))
        recorded.append(RecordedSite(f"{name}.out", module, "output", stack, layer, "norm_out"))
        norms.append(RecordedNorm(name, module, f"{name}.in", f"{name}.out", stack, layer))
    if not recorded:
        raise ValueError(
            f"{type(model).__name__}: found nothing to record. The recorder looked for gradscope Site modules, "
            "for repeated blocks (an nn.ModuleList of >= 2 children of one class holding parameters) and for "
            "normalisation modules (nn.LayerNorm, nn.RMSNorm, or a leaf class named *Norm). Name sites by hand by "
            "placing gradscope.Site() modules in your forward (x = self.hook_resid(x))."
        )
    outside, roles = outside_groups(model, [p for p in groups if p in position], {st for st, _ in position.values()})
    final = {f"{g}.{end}" for g, r in roles.items() if r == "final_norm" for end in ("in", "out")}
    recorded = [dataclasses.replace(p, role=f"final_{p.role}") if p.name in final and p.role in ("norm_in", "norm_out") else p
              for p in recorded]
    not_norms = [n for n, m in model.named_modules() if type(m).__name__.endswith("Norm") and not is_norm(m, n)
                 and next(m.children(), None) is None and any(p.dim() > 1 for p in m.parameters(recurse=False))]
    return Layout(recorded, norms, stacks, fill_groups(model, groups, outside), {}, foreign=True, group_roles=roles,
                  not_norms=not_norms)


def site_names(model: nn.Module) -> list[str]:
    """The sites the recorder recorded in ``model`` (a zoo model's Sites, or what it finds in
    any other ``nn.Module``): what ``Recorder(model).site_names`` gives."""
    return find_layout(model).site_names()


def find_layout(model: nn.Module, sites: list[str] | None = None) -> Layout:
    """Finds the sites, norms, stacks and parameter groups of ``model``.

    Args:
        model: a zoo model, or any ``nn.Module``.
        sites: optional shell-style (fnmatch) patterns (``"decoder.layers.*.ffn.sum"``; ``*``
            also matches dots, ``?`` one character); only matching sites are probed.
            A string is one pattern. ``ln_gain`` needs both sites of a norm kept,
            ``ln_w_over_sigma`` one of them, ``cosine`` all of a stack's outputs.

    Raises:
        ValueError: nothing to record, no pattern, or a pattern matches no site (the
            message lists some valid names).
    """
    layout = _zoo_layout(model) if is_zoo(model) else _foreign_layout(model)
    if isinstance(sites, str):
        sites = [sites]  # one pattern
    if sites is not None and not list(sites):
        raise ValueError(f"sites: an empty list; give patterns (['decoder.layers.*.out']), or None for every site "
                         f"({len(layout.site_names())} here)")
    if sites is not None:
        names = layout.site_names()
        for pattern in sites:
            if not fnmatch.filter(names, pattern):
                close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.3)
                raise ValueError(
                    f"sites: pattern {pattern!r} matches no site; closest: {close}; valid sites include "
                    f"{names[:4]} ... ({len(names)} in all; Recorder(model).site_names lists them)"
                )
        layout.sites = [p for p in layout.sites if any(fnmatch.fnmatchcase(p.name, pat) for pat in sites)]
        kept = set(layout.site_names())  # norm and stack quantities follow the sites kept
        layout.norms = [n for n in layout.norms if n.site_in in kept or n.site_out in kept]
        layout.stacks = [st for st in layout.stacks if all(s in kept for s in st.sites)]
    return layout
