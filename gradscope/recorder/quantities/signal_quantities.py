"""The quantity classes of the signals that precede instability (the instability issue):
``attn_logit_max``, ``attn_entropy``, ``attn_sink_mass``, ``attn_softcap_saturation``,
``output_logit_log_z`` (with ``output_logit_log_z_max``),
``sublayer_out_rms`` and ``grad_rms_over_eps``. Their capture is
:mod:`gradscope.recorder.capture.signals`; they are in :data:`gradscope.recorder.quantities.registry.REGISTRY`.

Each gives one row per step (``micro_step`` -1): the forward signals are accumulated over
the step's micro-batches (max of the maxima, mean of the means). Per-head rows carry the
head index (0-based) in ``layer_j``; the row with ``layer_j`` <NA> is the layer's (max over
heads for the logit, mean over heads for the others).
"""

from __future__ import annotations

import numpy as np
import torch

from gradscope.recorder.discovery.layout import Layout
from gradscope.recorder.quantities.quantity import Quantity
from gradscope.table.keys import Key, model_key


def position(layout: Layout, name: str) -> tuple[str, int | None]:
    """(stack, layer) of a module name: that of the longest parameter group containing it."""
    best, size = ("", None), -1
    for group, (stack, layer, _) in layout.param_groups.items():
        if group and (name == group or name.startswith(f"{group}.")) and len(group) > size:
            best, size = (stack, layer), len(group)
    return best


class _Signal(Quantity):
    """Shared parts: a NaN value means nothing was seen this step (no row)."""

    paper = "Wortsman et al. 2023"

    def rows(self, data):
        return [r for r in data.collected.get(self.name, []) if r[1] == r[1]]


class AttnLogitMax(_Signal):
    """max over sampled queries and allowed keys of q·k·scale, per head and per layer
    (Wortsman et al. 2023 §3.1; Dehghani et al. 2023)."""

    name, captures, which = "attn_logit_max", frozenset({"attention"}), 0
    description = "max over sampled queries and allowed keys of the attention logit q·k·scale, per head (layer_j) and layer"
    paper = "Wortsman et al. 2023, §3.1; Dehghani et al. 2023"

    def collect(self, ctx):
        signals = ctx.signals
        if not signals.attention:
            ctx.warn_once("attention", f"{self.name}: no attention module recognised in {type(ctx.model).__name__} "
                          "(q_proj/k_proj with a head count, or GPT-2's c_attn; see gradscope.recorder.capture.signals): "
                          "no attention rows")
        if signals.attention and signals.unrecognised:
            ctx.warn_once("attention_unrecognised", f"{self.name}: {signals.unrecognised[:4]} look like attention but "
                          "their q and k cannot be read (GPT-2's cross-attention, or q_proj/k_proj without a head count "
                          "named n_heads, num_heads or num_attention_heads): no rows for them")
        for i, reason in sorted(signals.unread.items()):
            a = signals.attention[i]
            ctx.warn_once(f"attention {a.name} {reason}", f"{self.name}: attention {a.name!r}: {reason}; its calls so "
                          "read have no rows. Not reported again.")
        for a, values in zip(signals.attention, signals.attention_values()):
            heads = values[self.which]
            _per_head(ctx, a.name, self.name, heads, heads.amax() if self.which == 0 else heads.mean())  # (NaN: no row)


class AttnEntropy(AttnLogitMax):
    """Mean over sampled queries of the attention distribution's entropy (nats), per head
    and per layer (Zhai et al. 2023: entropy collapse)."""

    name, which = "attn_entropy", 1
    description = "mean over sampled queries of the attention distribution's entropy (nats), per head and layer"
    paper = "Zhai et al. 2023"


class AttnSinkMass(AttnLogitMax):
    """Mean over sampled queries of the attention probability on key position 0, per head and
    per layer (Xiao et al. 2024: attention sinks; Gu et al. 2025). From the softmax the entropy
    reads (after a soft cap); a query that may not see key 0 adds 0."""

    name, which = "attn_sink_mass", 2
    description = ("mean over sampled queries of the attention probability on key position 0 (an attention sink), "
                   "per head and layer")
    paper = "Xiao et al. 2024; Gu et al. 2025"


class AttnSoftcapSaturation(AttnLogitMax):
    """Share of the allowed attention logits z a soft cap c saturates, |tanh(z/c)| > 0.95
    (:data:`~gradscope.recorder.capture.attention_signals.SOFTCAP_SATURATED`), per head and
    per layer; rows only for attention modules with a soft cap (Gemma 2's
    ``attn_logit_softcapping``), none (and no warning) for the others."""

    name, which = "attn_softcap_saturation", 3
    description = ("where the attention soft-caps its logits (Gemma 2), the share of allowed logits z with "
                   "|tanh(z/c)| > 0.95 (the cap passes back < 10% of their gradient), per head and layer")
    paper = "Gemma Team 2024 (Gemma 2), §2"


class OutputLogitLogZ(_Signal):
    """log Z = logsumexp of the output logits per token, the mean over the step's tokens
    (Wortsman et al. 2023 §3.2: z-loss keeps log Z near 0). The model's output is taken for
    logits when its last dimension is the size of one of its embedding tables or its
    ``config.vocab_size`` (HF outputs: ``.logits``)."""

    name, captures, which = "output_logit_log_z", frozenset({"logits"}), 0
    description = "mean over the step's tokens of log Z, the logsumexp of the output logits"
    paper = "Wortsman et al. 2023, §3.2"

    def collect(self, ctx):
        signals = ctx.signals
        if not signals.vocab:
            ctx.warn_once("logits", f"{self.name}: the model has no embedding table or config.vocab_size, "
                          "so its output is not taken for logits: no rows")
        elif signals.outputs and not signals.outputs_with_logits:
            ctx.warn_once("logits", f"{self.name}: the model's output held no logits (a tensor, or a tuple item, "
                          f"whose last dimension is the vocabulary, {sorted(signals.vocab)}; a model that returns "
                          "only its loss has none): no rows")
        ctx.add(model_key(self.name), signals.logz_values()[self.which])


class OutputLogitLogZMax(OutputLogitLogZ):
    """The max over the step's tokens of log Z (see :class:`OutputLogitLogZ`)."""

    name, which = "output_logit_log_z_max", 1
    description = "max over the step's tokens of log Z, the logsumexp of the output logits"


class SublayerOutRms(_Signal):
    """RMS of each sub-layer (residual branch) output, sqrt(mean h²) over the step's
    tokens and features (Rybakov et al. 2024: output norms grow before divergence)."""

    name, captures = "sublayer_out_rms", frozenset({"rms"})
    description = "RMS of each sub-layer's (residual branch's) output over the step's tokens and features"
    paper = "Rybakov et al. 2024"

    def collect(self, ctx):
        subs = ctx.signals.sublayers
        gaps = ctx.signals.sublayer_gaps
        if gaps:
            ctx.warn_once("sublayer_gaps", f"{self.name}: {'; '.join(gaps[:3])}{' ...' if len(gaps) > 3 else ''}")
        if subs:
            keys = [Key(-1, *position(ctx.layout, n), n, self.name, None, "branch") for n, _ in subs]
            ctx.add_many(keys, ctx.signals.rms_values()[: len(subs)])


class GradRmsOverEps(_Signal):
    """Per parameter group, the RMS of g/ε over its elements (Wortsman et al. 2023 §3.4;
    Everett et al. 2024): near or below 1, Adam's update shrinks.

    sqrt(Σ_p ‖g_p‖²/ε_p² / Σ_p n_p) over the group's parameters that have a gradient and
    that the optimizer steps, each with the ε of its own optimizer group (a decay / no-decay
    split may give a layer's weights and biases different ε); ‖g‖/√n/ε when they share one.
    """

    name, needs_backward, reads_param_grads = "grad_rms_over_eps", True, True
    description = "per parameter group, the RMS of g / ε over its elements (Adam's update shrinks near 1)"
    paper = "Wortsman et al. 2023, §3.4; Everett et al. 2024"

    def collect(self, ctx):
        params = ctx.groups.params  # (read once: each read checks the module tree)
        eps = _param_eps(ctx.optimizer, params)
        if eps is None:
            ctx.warn_once(self.name, "grad_rms_over_eps needs the optimizer (Recorder(optimizer=...)) and an 'eps' "
                          "in its param groups (Adam, AdamW, ...): no rows")
            return
        sq = ctx.param_grad_squares()
        if sq is None:
            return
        counted = [has and e is not None for has, e in zip(ctx.has_grads(), eps)]  # frozen or not stepped: left out
        numel = np.array([float(p.numel()) if c else 0.0 for p, c in zip(params, counted)])
        elements = ctx.groups.host_sums(numel)  # per group, on the host: which groups have a row
        weight = torch.tensor([1.0 / e**2 if c else 0.0 for e, c in zip(eps, counted)], dtype=torch.float64)
        over_eps = ctx.groups.membership(sq.device).double() @ (sq.double() * weight.to(sq.device))
        at = [i for i, n in enumerate(elements.tolist()) if n > 0]
        if not at:
            return
        keys = ctx.groups.keys(self.name)
        index = torch.tensor(at, device=sq.device)
        rms = (over_eps[index] / torch.tensor(elements[at], device=sq.device)).sqrt().float()
        ctx.add_many([keys[i] for i in at], rms)


def _param_eps(opt, params: list) -> list[float | None] | None:
    """Adam's ε of each of ``params`` (None for one the optimizer ``opt`` does not step), or
    None without an optimizer with ε."""
    if opt is None or not all("eps" in g for g in opt.param_groups):
        return None
    eps = {id(p): float(g["eps"]) for g in opt.param_groups for p in g["params"]}
    return [eps.get(id(p)) for p in params]


def _per_head(ctx, site: str, quantity: str, heads: torch.Tensor, layer: torch.Tensor) -> None:
    stack, pos = position(ctx.layout, site)
    keys = [Key(-1, stack, pos, site, quantity, h, "") for h in range(heads.numel())]
    ctx.add_many([*keys, Key(-1, stack, pos, site, quantity, None, "")], torch.cat([heads.reshape(-1), layer.reshape(1)]))
