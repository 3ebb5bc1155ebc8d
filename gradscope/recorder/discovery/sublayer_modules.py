"""The sub-layers whose outputs are residual branches (``sublayer_out_rms``,
:mod:`gradscope.recorder.capture.signals`), and what cannot be measured as one in a foreign block."""

from __future__ import annotations

from torch import nn

from gradscope.recorder.discovery.layout import Layout, block_width, is_norm


QK_NORMS = frozenset({"q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_norm", "key_norm",
                      "query_layernorm", "key_layernorm", "qk_norm"})
"""Names of the norms an attention applies to its queries and keys (Qwen 3, OLMo 2, Gemma 3):
they leave its output a residual branch."""


def find_sublayers(model: nn.Module, layout: Layout) -> list[tuple[str, nn.Module]]:
    """(name, module) of every sub-layer whose output is a residual branch: the zoo's
    ``branch`` sites; in a foreign model's block, each child that holds parameters, has
    children of its own and is not a norm (HF ``self_attn``/``mlp``), or the block itself
    when it has none (x-transformers keeps attention and feed-forward as separate blocks)."""
    if not layout.foreign:
        return [(p.name, p.module) for p in layout.sites if p.role == "branch"]
    return _foreign_sublayers(layout)[0]


def sublayer_gaps(model: nn.Module, layout: Layout) -> list[str]:
    """What :func:`find_sublayers` cannot measure as a residual branch in a foreign model's
    blocks, one line each: parameters outside the sub-layers it found (``nn.TransformerEncoderLayer``'s
    feed-forward is two bare ``Linear`` children), and sub-layers that hold a norm (a Post-LN
    block whose norm is inside the sub-layer, as BERT's: its output is normalised, not the branch)."""
    return [] if not layout.foreign else _foreign_sublayers(layout)[1]


def _foreign_sublayers(layout: Layout) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """(the sub-layers measured, what cannot be: one line per block). In a block without norms
    of its own, a child is no branch, and is left out, when it holds a norm other than a
    query/key norm (:data:`QK_NORMS`: its output is normalised, a Post-LN block such as BERT's
    adding the residual inside it), or when it sits beside such children (it feeds one: BERT's
    ``intermediate``, whatever its width). In any block, a child whose last ``nn.Linear`` is not
    as wide as the block's output is left out too (a feed-forward's hidden activation)."""
    out, gaps, seen = [], [], set()
    for p in layout.sites:
        if p.role != "layer_out" or id(p.module) in seen:
            continue
        seen.add(id(p.module))
        prefix = p.name[: -len(".out")]
        inner = [(n, c) for n, c in p.module.named_children()
                 if not is_norm(c, n) and next(c.parameters(), None) is not None
                 and any(next(g.parameters(), None) is not None for g in c.children())]
        if not inner:
            out.append((prefix, p.module))
            continue
        width = block_width(p.module)
        # (a block with norms of its own adds its residuals itself: norms inside its children are
        # theirs, as StableLM's or DeepSeek's q/kv norms, or a sandwich norm inside an mlp)
        own_norms = any(is_norm(c, n) for n, c in p.module.named_children())
        normed = [] if own_norms else [
            n for n, c in inner if any(is_norm(g, gn) and not QK_NORMS & set(gn.split("."))
                                       for gn, g in c.named_modules() if g is not c)]
        # (beside a sub-layer that adds the residual inside it, the others feed one: BERT's intermediate)
        feeding = [n for n, _ in inner if n not in normed] if normed else []
        narrow = [n for n, c in inner if n not in normed and n not in feeding and width is not None
                  and (lin := [m for m in c.modules() if isinstance(m, nn.Linear)]) and lin[-1].out_features != width]
        out += [(f"{prefix}.{n}", c) for n, c in inner if n not in normed and n not in narrow and n not in feeding]
        covered = {n for n, _ in inner}
        left = [n for n, c in p.module.named_children() if n not in covered and not is_norm(c, n)
                and next(c.parameters(), None) is not None]
        if left:
            gaps.append(f"{prefix}: {left} hold parameters outside the sub-layers found ({sorted(covered)}), so "
                        "their branch has no row")
        if normed:
            gaps.append(f"{prefix}: {normed} hold a norm, so their output is normalised (a Post-LN block that adds the "
                        "residual inside them), not the residual branch: no row")
        if feeding:
            gaps.append(f"{prefix}: {feeding} sit beside sub-layers that add the residual inside them ({normed}), so "
                        "they are part of one (a Post-LN feed-forward's first half, as BERT's intermediate), not a "
                        "residual branch: no row")
        if narrow:
            gaps.append(f"{prefix}: {narrow} end in a projection narrower or wider than the block's output "
                        f"({width}), so they are no residual branch: no row")
    return out, gaps
