"""The built-in quantities, one class each, and :data:`REGISTRY`, the one list of them.

Each class holds everything about its quantity (:class:`~gradscope.recorder.quantities.quantity.Quantity`):
what it captures, its schedule, its rows, how ranks combine it, whether ``spike`` watches
it, and its description. The table's ``quantity`` values, the presets, validation,
:func:`gradscope.distributed.global_rows`, the spike watch and the quantity reference
(:func:`reference`) are all read from :data:`REGISTRY`. A user's own quantity is an
instance passed to the Recorder, not an entry here.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gradscope.recorder.quantities.combine import ratio
from gradscope.recorder.quantities.quantity import Quantity
from gradscope.recorder.quantities.signal_quantities import (
    AttnEntropy,
    AttnLogitMax,
    GradRmsOverEps,
    OutputLogitLogZ,
    OutputLogitLogZMax,
    SublayerOutRms,
)
from gradscope.recorder.quantities.step_data import StepData, call_name
from gradscope.table.keys import Key

__all__ = ["REGISTRY", "Quantity", "StepData", "call_name", "reference", "resolve_quantities"]


class ActNorm(Quantity):
    """‖h‖₂ of a site's forward value; several forwards of one micro-step count together
    (√Σ‖h_f‖², their batches taken as one), and the accumulated row is the norm over all
    micro-batches."""

    name, captures = "act_norm", frozenset({"value"})
    description = "‖h‖₂ of the tensor crossing a site (the step's row: over all micro-batches)"
    across_ranks = "rss"

    def rows(self, data):
        sites = data.slot_sites()
        slots = data.slots()
        called = data.order[:, slots] != 0  # (M, n)
        value = np.where(called, data.value[:, slots], 0.0)
        total = np.sqrt(np.square(value).sum(axis=0)).tolist()
        if data.micro_steps == 1:
            return [(k, v) for k, v, c in zip(data.step_keys(self.name), total, called[0].tolist()) if c]
        out = []
        for j, ((p, _, _, site), any_call) in enumerate(zip(sites, called.any(axis=0).tolist())):
            if not any_call:
                continue
            out += [(Key(m, p.stack, p.layer, site, self.name, None, p.role), float(value[m, j]))
                    for m in np.flatnonzero(called[:, j]).tolist()]
            out.append((Key(-1, p.stack, p.layer, site, self.name, None, p.role), total[j]))
        return out


class ActGradNorm(Quantity):
    """‖∂loss/∂h‖₂ over the whole tensor crossing a site (Takase Fig. 3-4)."""

    name, captures, needs_backward = "act_grad_norm", frozenset({"grad"}), True
    description = "‖∂loss/∂h‖₂ over the whole tensor crossing a site; at a norm's input, through that norm alone"
    paper = "Takase et al. 2022, Fig. 3-4; Liu et al. 2020, Fig. 3"
    across_ranks, spike_watched = "gradient_norm", True

    def rows(self, data):
        sites = data.slot_sites()
        slots = data.slots()
        got = data.got[:, slots]
        sq = np.where(got, data.grad_sq[:, slots], 0.0)
        total = np.sqrt(sq.sum(axis=0)).tolist()
        if data.micro_steps == 1:
            return [(k, v) for k, v, g in zip(data.step_keys(self.name), total, got[0].tolist()) if g]
        out = []
        for j, ((p, _, _, site), any_grad) in enumerate(zip(sites, got.any(axis=0).tolist())):
            if not any_grad:
                continue
            out += [(Key(m, p.stack, p.layer, site, self.name, None, p.role), math.sqrt(sq[m, j]))
                    for m in np.flatnonzero(got[:, j]).tolist()]
            out.append((Key(-1, p.stack, p.layer, site, self.name, None, p.role), total[j]))
        return out


class NonFinite(Quantity):
    """Sites whose value (``nonfinite``) or gradient (``nonfinite_grad``) held a NaN/Inf, in
    order of appearance (forward order; backward runs in reverse), value 0 first."""

    name, captures, also_names = "nonfinite", frozenset({"value", "grad"}), ("nonfinite_grad",)
    description = ("sites whose forward value (nonfinite) or gradient (nonfinite_grad) held a NaN/Inf; "
                   "value = order of appearance, 0 first")

    def rows(self, data):
        out = []
        if np.isfinite(data.value).all() and np.isfinite(data.grad_sq).all():
            return out
        for m in range(data.micro_steps):
            fwd, bwd = [], []
            for p, c, slot, site in data.slot_sites():
                order = abs(data.order[m, slot])
                if order and not math.isfinite(data.value[m, slot]):
                    fwd.append((order, p, site))
                if not math.isfinite(data.grad_sq[m, slot]):
                    bwd.append((-order, p, site))
            for quantity, found in (("nonfinite", fwd), ("nonfinite_grad", bwd)):
                for rank, (_, p, site) in enumerate(sorted(found, key=lambda f: f[0])):
                    out.append((Key(data.micro(m), p.stack, p.layer, site, quantity, None, p.role), float(rank)))
        return out


class LnGain(Quantity):
    """‖grad at the norm's input through the norm alone‖ / ‖grad at its output‖ (Takase §3):
    the factor by which backward through that norm scales the gradient."""

    name, captures, needs_backward = "ln_gain", frozenset({"grad"}), True
    description = "‖gradient at a norm's input, through the norm alone‖ / ‖gradient at its output‖"
    paper = "Takase et al. 2022, §3"

    def rows(self, data):
        index = {p.name: i for i, p in enumerate(data.points)}
        norms = [n for n in data.layout.norms if n.site_in in index and n.site_out in index and n.name not in data.unfit]
        calls = np.arange(data.K)
        if data.micro_steps == 1 and norms:
            return self._rows_of_one_micro_step(data, norms, index)
        out = []
        for norm in norms:
            s_in, s_out = index[norm.site_in] * data.K + calls, index[norm.site_out] * data.K + calls
            got = data.got[:, s_in] & data.got[:, s_out]  # (M, K)
            for c in np.flatnonzero(got.any(axis=0)).tolist():
                g_in, g_out = data.grad_sq[got[:, c], s_in[c]], data.grad_sq[got[:, c], s_out[c]]
                key = (norm.stack, norm.layer, call_name(norm.name, c), self.name, None, "")
                if data.micro_steps > 1:
                    out += [(Key(m, *key), ratio(math.sqrt(a), math.sqrt(b)))
                            for m, a, b in zip(np.flatnonzero(got[:, c]).tolist(), g_in.tolist(), g_out.tolist())]
                out.append((Key(-1, *key), ratio(math.sqrt(g_in.sum()), math.sqrt(g_out.sum()))))
        return out

    def _rows_of_one_micro_step(self, data, norms: list, index: dict[str, int]) -> list:
        """The rows of a step of one micro-step, every norm at once (the loop above's rows, in its order)."""
        K = data.K
        s_in = np.array([index[n.site_in] for n in norms])[:, None] * K + np.arange(K)  # (norms, K)
        s_out = np.array([index[n.site_out] for n in norms])[:, None] * K + np.arange(K)
        got, sq = data.got[0], data.grad_sq[0]
        at = np.flatnonzero(got[s_in] & got[s_out])  # norm by norm, call by call
        keys = data.kept_keys((self.name, tuple(at.tolist()), tuple(n.name for n in norms)), lambda: [
            Key(-1, norms[a // K].stack, norms[a // K].layer, call_name(norms[a // K].name, a % K), self.name, None, "")
            for a in at.tolist()])
        g_in, g_out = np.sqrt(sq[s_in.ravel()[at]]).tolist(), np.sqrt(sq[s_out.ravel()[at]]).tolist()
        return [(k, ratio(a, b)) for k, a, b in zip(keys, g_in, g_out)]


class WOverSigma(Quantity):
    """mean over tokens and features of w/σ per norm call (Xu 2020 Table 2); the accumulated
    row averages the micro-steps. See :mod:`gradscope.recorder.numerics.norm_stats`."""

    name, captures = "ln_w_over_sigma", frozenset({"wsig"})
    description = "mean over tokens and features of a norm's gain w / σ (the token's standard deviation)"
    paper = "Xu et al. 2020, Table 2"

    def rows(self, data):
        out = []
        base = len(data.points) * data.K
        for j, norm in enumerate(data.layout.norms):
            if norm.name in data.unfit:
                continue
            slots = base + j * data.K + np.arange(data.K)
            got = data.order[:, slots] != 0  # (M, K)
            for c in np.flatnonzero(got.any(axis=0)).tolist():
                key = (norm.stack, norm.layer, call_name(norm.name, c), self.name, None, "")
                vals = data.value[got[:, c], slots[c]]
                if data.micro_steps > 1:
                    out += [(Key(m, *key), v) for m, v in zip(np.flatnonzero(got[:, c]).tolist(), vals.tolist())]
                out.append((Key(-1, *key), float(vals.mean())))
        return out


class Cosine(Quantity):
    """S[i, j] = mean over sampled non-pad tokens of cos(y_i, y_j), y_0 the embedding (Takase Fig. 5)."""

    name, captures, slow = "cosine", frozenset({"cosine"}), True
    description = "S[i, j]: mean over sampled non-pad tokens of cos(y_i, y_j) of layer outputs (y_0 the embedding)"
    paper = "Takase et al. 2022, Fig. 5"

    def collect(self, ctx):
        for stack, (matrix, written) in ctx.cosine_matrices().items():
            site = stack if ctx.layout.foreign else f"{stack}.layers"  # the layer list's module name
            ctx.add_matrix(stack, site, self.name, matrix)
            ctx.add_block(f"cosine_written:{stack}", written)

    def rows(self, data):
        complete = {k.split(":", 1)[1] for k, w in data.blocks.items() if k.startswith("cosine_written:") and w.all()}
        return [r for r in data.device.get(self.name, []) if r[0].stack in complete]


class ParamGradNorm(Quantity):
    """‖grad‖ of parameters per layer, per sub-layer, per embedding, and in total (site "")."""

    name, needs_backward = "param_grad_norm", True
    description = "‖p.grad‖ per parameter group (every parameter in one leaf group) and in total (site \"\")"
    across_ranks, spike_watched = "shared", True

    def collect(self, ctx):
        norms = ctx.group_grad_norms()
        if norms is not None:
            ctx.add_many(*_with_grads(ctx, ctx.groups.keys(self.name), norms))


class DlclWeight(Quantity):
    """DLCL W[r, k] (lower triangle) and transparent-attention weights (Wang 2019 Fig. 5)."""

    name, across_ranks = "dlcl_weight", "shared"
    description = "DLCL's layer-combination weights W[r, k] (lower triangle) and transparent attention's"
    paper = "Wang et al. 2019, Fig. 5"

    def collect(self, ctx):
        for name, mixer in ctx.layout.mixers.items():
            stack = name.split(".")[0] if name.startswith(("encoder", "decoder")) else ""
            ctx.add_matrix(stack, name, self.name, mixer.mixing_weights())

    def rows(self, data):
        return [r for r in data.device.get(self.name, [])
                if not (r[0].site.endswith("combine") and r[0].layer_j > r[0].layer)]


class ScaleNormG(Quantity):
    """The learned g of every ScaleNorm (Nguyen & Salazar 2019)."""

    name, across_ranks = "scalenorm_g", "shared"
    description = "the learned scale g of every ScaleNorm"
    paper = "Nguyen & Salazar 2019"

    def collect(self, ctx):
        for norm in ctx.layout.norms:
            g = getattr(norm.module, "g", None)
            if isinstance(g, torch.Tensor) and g.dim() == 0:
                ctx.add(Key(-1, norm.stack, norm.layer, norm.name, self.name, None, ""), g)


class Lr(Quantity):
    """The optimizer's learning rate (first group), when the Recorder was given the optimizer."""

    name, across_ranks = "lr", "shared"
    description = ("the optimizer's learning rate (first parameter group), when the Recorder was given the optimizer: "
                   "the one its step used when it stepped inside the recorded step")

    def collect(self, ctx):
        if ctx.lr_from_optimizer and ctx.optimizer is not None:
            lr = ctx.lr_used if ctx.lr_used is not None else ctx.optimizer.param_groups[0]["lr"]  # (the update's own)
            ctx.add_model_value(self.name, float(lr))


class Logged(Quantity):
    """A scalar the training loop logs itself (``rec.log("loss", loss)``)."""

    logged = True

    def __init__(self, name: str, description: str, across_ranks: str = "local") -> None:
        self.name, self.description, self.across_ranks = name, description, across_ranks


class UpdateRatio(Quantity):
    """‖Δθ‖/‖θ‖ per parameter group around ``optimizer.step()`` (rows written by the Recorder's
    optimizer hooks, after the step's other rows)."""

    name, slow, across_ranks = "update_ratio", True, "shared"
    description = ("‖Δθ‖ / ‖θ‖ per parameter group across optimizer.step() (needs Recorder(optimizer=...)); no "
                   "row for a group whose ‖θ‖ was 0 before the step (a warning)")

    def rows(self, data):
        return []  # written after optimizer.step() (gradscope.recorder.capture.update_ratio)


class Spike(Quantity):
    """A value far above its own recent past (:mod:`gradscope.recorder.quantities.spike`); its rows are
    added by the Recorder's outlet as each step's rows pass, from the watched quantities."""

    name = "spike"
    description = ("z-score (above 6) of a value against its series' previous 128 recorded values, for every "
                   "quantity whose spike_watched is set")
    paper = "OLMo-core's loss-spike rule"

    def rows(self, data):
        return []  # written as each step's rows pass the outlet (gradscope.recorder.quantities.spike)


class Replay(Quantity):
    """A step the spike watch flagged (``Recorder(on_spike="replay")``,
    :mod:`gradscope.recorder.replay.replay`), recorded by running it again unless the schedule
    recorded it already; rows written by the watch."""

    name, also_names, taken = "replay", ("replay_mismatch",), "on a step the on_spike watch flagged"
    logged_by_gradscope = True  # (Recorder.log takes the name from the replay)
    description = ("a step the on_spike watch flagged for its loss or gradient norm, recorded by re-running it "
                   "(or by the schedule): value = the watch's z-score; replay_mismatch: relative difference of the replayed loss or "
                   "gradient norm from the original, when not 0")
    paper = "OLMo-core's loss-spike rule; Megatron's RerunStateMachine"

    def rows(self, data):
        return []  # logged by the replay (gradscope.recorder.replay.replay)


REGISTRY: dict[str, Quantity] = {
    q.name: q for q in (
        ActGradNorm(), ActNorm(), ParamGradNorm(), LnGain(),
        Logged("loss", "the training loss the loop logs (rec.log('loss', loss)); micro-batches: their mean", "loss"),
        Lr(), NonFinite(), WOverSigma(), Cosine(), DlclWeight(), ScaleNormG(), UpdateRatio(),
        Logged("val_loss", "the validation loss the loop logs (rec.log('val_loss', v, step=...))"),
        AttnLogitMax(), AttnEntropy(), OutputLogitLogZ(), OutputLogitLogZMax(), SublayerOutRms(), GradRmsOverEps(),
        Spike(), Replay(),
    )
}
"""Quantity name -> the built-in quantity. The one source of the quantity names, presets,
rank rules and spike watch; ``nonfinite_grad`` rows come with ``nonfinite``."""

QUANTITY_NAMES: tuple[str, ...] = tuple(n for q in REGISTRY.values() for n in q.names)
"""Every ``quantity`` value a built-in quantity writes."""

# -- the quantities a Recorder takes ------------------------------------------------------------
DEFAULT_QUANTITIES = ("act_grad_norm", "act_norm", "param_grad_norm", "ln_gain", "loss", "lr", "nonfinite")
ALL_QUANTITIES = DEFAULT_QUANTITIES + ("ln_w_over_sigma", "cosine", "dlcl_weight", "scalenorm_g", "update_ratio", "spike")
SIGNAL_QUANTITIES = ("attn_logit_max", "attn_entropy", "output_logit_log_z", "output_logit_log_z_max", "sublayer_out_rms",
                     "grad_rms_over_eps")  # signals before instability (gradscope.recorder.capture.signals)
PRESETS: dict[str, tuple[str, ...]] = {"default": DEFAULT_QUANTITIES, "all": ALL_QUANTITIES,
                                       "signals": DEFAULT_QUANTITIES + SIGNAL_QUANTITIES}


def _with_grads(ctx, keys: list, values: torch.Tensor) -> tuple[list, torch.Tensor]:
    """The keys and values of the parameter groups that have a gradient (all, usually)."""
    ok = ctx.groups_with_grads()
    if all(ok):
        return keys, values
    at = [i for i, k in enumerate(ok) if k]
    return [keys[i] for i in at], values[torch.tensor(at, device=values.device)]


def resolve_quantities(quantities: str | tuple | list) -> dict[str, Quantity]:
    """The Recorder's quantities, by name: a preset (``"default"``, ``"all"``, ``"signals"``)
    or a list of built-in names (:data:`REGISTRY`) and :class:`Quantity` instances.

    Raises:
        ValueError: an unknown preset or name (the message lists the valid ones), a name
            that only comes with another quantity (``nonfinite_grad``), two quantities of
            one name, or a user quantity that breaks the contract.
    """
    if isinstance(quantities, str):
        if quantities not in PRESETS:
            raise ValueError(f"quantities: unknown preset {quantities!r}; valid: {sorted(PRESETS)} or a list of "
                             f"{list(REGISTRY)} and gradscope.Quantity instances")
        quantities = PRESETS[quantities]
    if not isinstance(quantities, (tuple, list)):
        raise ValueError(f"quantities: 'default', 'all', 'signals' or a list of names from {sorted(REGISTRY)} and "
                         f"gradscope.Quantity instances; got {quantities!r}")
    if not quantities:
        raise ValueError(f"quantities: an empty list; give a preset ({sorted(PRESETS)}) or names from {sorted(REGISTRY)}")
    unknown = [q for q in quantities if isinstance(q, str) and q not in REGISTRY]
    if unknown:
        homes = {q: h.name for q in unknown for h in REGISTRY.values() if q in h.also_names}
        hint = "".join(f" ({q!r} rows come with {h!r}: ask for that)" for q, h in homes.items())
        raise ValueError(f"quantities: unknown {unknown}{hint}; valid: {sorted(REGISTRY)} or gradscope.Quantity instances")
    out: dict[str, Quantity] = {}
    for q in quantities:
        if isinstance(q, str):
            q = REGISTRY[q]
        elif isinstance(q, Quantity):
            q.check()
            taken = {n for b in REGISTRY.values() for n in b.names} & set(q.names)
            if taken and not any(q is b for b in REGISTRY.values()):
                raise ValueError(f"quantities: {type(q).__name__} is named {sorted(taken)}, a built-in quantity's name "
                                 "(its rows would pass for the built-in's, and ranks would combine them by its rule): "
                                 "give it a name of its own")
        else:
            made = " (a class: pass an instance, " + q.__name__ + "())" if isinstance(q, type) else ""
            raise ValueError(f"quantities: {q!r} is neither a quantity name nor a gradscope.Quantity instance{made}")
        if q.name in out and out[q.name] is not q:
            raise ValueError(f"quantities: two quantities named {q.name!r}")
        out[q.name] = q
    return out


def reference() -> str:
    """The quantity reference as a markdown table, generated from :data:`REGISTRY` (the
    docs and the README's table are this, so they cannot drift)."""
    lines = ["| quantity | what it is | taken | across ranks | spike watched | source |", "|---|---|---|---|---|---|"]
    for q in REGISTRY.values():
        taken = q.taken or ("every slow_every-th recorded step" if q.slow else "logged by the loop" if q.logged
                            else "every recorded step")
        name = " / ".join(f"`{n}`" for n in q.names)
        lines.append(f"| {name} | {q.description} | {taken} | {q.across_ranks} | {'yes' if q.spike_watched else ''} "
                     f"| {q.paper} |")
    return "\n".join(lines) + "\n"
