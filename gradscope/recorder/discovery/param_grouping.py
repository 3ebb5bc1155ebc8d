"""Parameter groups (:class:`~gradscope.recorder.discovery.layout.Layout`'s ``param_groups``): the leaf
groups outside a foreign model's repeated blocks, one per module that owns parameters, with
its role (``embedding``, ``final_norm``, ``head``, ``other``); and, for zoo and foreign models
alike, every parameter name put in the groups whose prefix it has."""

from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize

from gradscope.recorder.discovery.norm_modules import is_norm

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
"""Modules that hold sub-modules without being a part of their own (an ``nn.Sequential``
computes: a sub-layer written as one, an MLP, is a part)."""


def outside_groups(model: nn.Module, blocks: list[str], stacks: set[str] = frozenset()) -> tuple[dict, dict[str, str]]:
    """A leaf group for every module outside the blocks that owns parameters (by their first
    name, so a tied LM head adds nothing twice), with its role, by where it is registered
    relative to the blocks: ``embedding`` (an ``nn.Embedding``, or anything before the first
    block, or a module named ``embed...``: BERT's embedding LayerNorm, BART's
    ``layernorm_embedding``, a feature encoder), ``final_norm`` (a norm beside a list of
    blocks, in the same parent, that is the first module after that list or is named
    ``final``: Llama's ``model.norm``, GPT-2's ``ln_f``, ``nn.Transformer``'s
    ``encoder.norm``, OPT's ``final_layer_norm``; not a norm inside a head),
    ``head`` (anything else after the last block: LM head, pooler, classifier) or ``other``
    (a module beside a block in the same list entry, as x-transformers' norms; and, in a
    model without a list of blocks, whatever is no embedding and no final norm, as there is
    no before or after then)."""
    modules = dict(model.named_modules())
    order = {name: i for i, name in enumerate(modules)}
    first_block = min((order[b] for b in blocks), default=len(order))
    inside = [i for name, i in order.items() if any(name == b or name.startswith(f"{b}.") for b in blocks)]
    last_block = max(inside, default=-1)  # (a module shared by two blocks is listed under the first only)
    entries = {b.rpartition(".")[0] for b in blocks}  # the list entries the blocks are in
    owners = []
    for pname, _ in model.named_parameters():
        if not any(pname.startswith(f"{b}.") for b in blocks):
            owners.append((pname.rpartition(".")[0], pname))
    ends = [max(i for name, i in order.items() if name == b or name.startswith(f"{b}.")) for b in blocks]
    taken = sorted({order[o] for o, _ in owners})

    named_embed = {order[o] for o, _ in owners if "embed" in o.rpartition(".")[2].lower()}
    parents = {st.rpartition(".")[0] for st in stacks}  # where a stack's final norm sits, beside the list

    def right_after_a_stack(at: int) -> bool:  # the first owner after some block list ends (nn.Transformer's encoder.norm)
        end = max((e for e in ends if e < at), default=None)
        return (end is not None and not any(end < i < at and i not in named_embed for i in taken)
                and not any(end < order[b] < at for b in blocks))
    groups: dict[str, tuple] = {}
    roles: dict[str, str] = {}
    for owner, pname in owners:
        module, group = modules[owner], owner or pname  # a parameter of the root: a group of its own
        if group not in groups:
            beside = owner.rpartition(".")[0] in parents or not stacks
            if "embed" in owner.rpartition(".")[2].lower():
                roles[group] = "embedding"
            elif beside and "final" in owner.rpartition(".")[2] and (is_norm(module, owner) or "norm" in owner.rpartition(".")[2].lower()):
                roles[group] = "final_norm"
            elif any(owner.startswith(f"{e}.") for e in entries if e) and not any(owner.startswith(f"{b}.") for b in blocks):
                roles[group] = "other"  # beside a block in its list entry (x-transformers: [norms, block, residual])
            elif isinstance(module, nn.Embedding) or (blocks and order[owner] < first_block):
                roles[group] = "embedding"
            elif beside and is_norm(module, owner) and right_after_a_stack(order[owner]):
                roles[group] = "final_norm"
            elif blocks and order[owner] > last_block:
                roles[group] = "head"
            else:
                roles[group] = "other"
            groups[group] = ("", None, [])
        groups[group][2].append(pname)
    for group in [g for g in groups if any(o.startswith(f"{g}.") for o in groups)]:  # a module's own parameters
        members, role = groups.pop(group)[2], roles.pop(group)  # beside a child's group: one leaf group each
        for pname in members:
            groups[pname], roles[pname] = ("", None, [pname]), role
    return groups, roles


def block_groups(prefix: str, block: nn.Module) -> list[str]:
    """The parameter groups inside one block of a foreign model, named from ``prefix``: each
    child that holds parameters (a sub-layer), with these exceptions, so that no two groups
    hold the same parameters and a sub-layer is a group wherever the model has one:

    - a container child (``nn.ModuleList``, T5's ``layer``) is no group: its entries are
      (T5's ``layer.0`` self-attention, ``layer.1`` feed-forward);
    - a lone child that holds all the block's parameters is no group either (it would equal
      the block's): its own parts are, if it has any (a module whose parameters are all its
      own, or reparametrized, as by weight norm, is one part);
    - a mixture-of-experts sub-layer (a child whose children are named ``*expert*``) is a
      group, and so is each of its parts: the router, the routed experts, the shared expert;
    - a parameter of the block itself is a leaf group.
    """
    children = [(n, c) for n, c in block.named_children() if _holds_parameters(c)]
    own = [n for n, _ in block.named_parameters(recurse=False)]
    if len(children) == 1 and not own and not isinstance(children[0][1], CONTAINERS):
        name, child = children[0]
        return [] if _one_part(child) else block_groups(f"{prefix}.{name}", child)
    groups = []
    for name, child in children:
        if isinstance(child, CONTAINERS):
            groups += [f"{prefix}.{name}.{k}" for k, entry in child.named_children() if _holds_parameters(entry)]
            groups += [f"{prefix}.{name}.{k}" for k, _ in child.named_parameters(recurse=False)]
            continue
        groups.append(f"{prefix}.{name}")
        if not _one_part(child) and any("expert" in n.lower() for n, _ in child.named_children()):
            groups += [f"{prefix}.{name}.{n}" for n, c in child.named_children() if _holds_parameters(c)]
            groups += [f"{prefix}.{name}.{n}" for n, _ in child.named_parameters(recurse=False)]
    return groups + [f"{prefix}.{n}" for n in own]


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _one_part(module: nn.Module) -> bool:
    """Whether a module is one part, not to be split: all its parameters are its own, or it
    is reparametrized (``torch.nn.utils.parametrize``: weight norm, spectral norm)."""
    return parametrize.is_parametrized(module) or not any(_holds_parameters(c) for c in module.children())


def fill_groups(model: nn.Module, groups: dict, filled: dict | None = None) -> dict:
    """Puts every parameter name in the groups whose prefix it has. A parameter shared by
    two modules is listed under each of its names in the groups that hold others (both
    blocks' layer groups), but in one leaf group only, that of its first name, so that the
    leaf groups' squares add up to the total's. ``filled``: groups whose members are given
    (by first name only), added as they are."""
    for pname, _ in model.named_parameters(remove_duplicate=False):
        groups[""][2].append(pname)
        for gname, (_, _, members) in groups.items():
            if gname and pname.startswith(f"{gname}."):
                members.append(pname)
    first = {n for n, _ in model.named_parameters()}
    for gname, (_, _, members) in groups.items():
        if gname and not any(other.startswith(f"{gname}.") for other in groups):  # a leaf group
            members[:] = [m for m in members if m in first]
    groups.update(filled or {})
    return {g: v for g, v in groups.items() if v[2]}
