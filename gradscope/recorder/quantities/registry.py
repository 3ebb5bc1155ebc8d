""":data:`REGISTRY`, the one list of the built-in quantities (:mod:`.built_in`), the named
sets of them a Recorder takes (:data:`QUANTITY_SETS`), and the reference generated from it.

Each class holds everything about its quantity (:class:`~gradscope.recorder.quantities.quantity.Quantity`):
what it captures, its schedule, its rows, how ranks combine it, whether ``spike`` watches
it, and its description. The table's ``quantity`` values, the presets, validation,
:func:`gradscope.distributed.global_rows`, the spike watch and the quantity reference
(:func:`reference`) are all read from :data:`REGISTRY`. A user's own quantity is an
instance passed to the Recorder, not an entry here.
"""

from __future__ import annotations

from gradscope.recorder.quantities.built_in import (ActGradNorm, ActNorm, Cosine, DlclWeight, Logged, LnGain, Lr,
                                                    NonFinite, ParamGradNorm, Replay, ScaleNormG, Spike, UpdateRatio,
                                                    WOverSigma)
from gradscope.recorder.quantities.moe import EXPERTS, ROUTING
from gradscope.recorder.quantities.outliers import ActAbsMax, ActKurtosis, MassiveActCount
from gradscope.recorder.quantities.quantity import Quantity
from gradscope.recorder.quantities.weights import (AdamVSqrtMax, AdamVSqrtMean, ParamNorm, ParamRms, SpectralNorm,
                                                   StableRank, UpdateRms)
from gradscope.recorder.quantities.signal_quantities import (
    AttnEntropy,
    AttnLogitMax,
    AttnSinkMass,
    AttnSoftcapSaturation,
    GradRmsOverEps,
    OutputLogitLogZ,
    OutputLogitLogZMax,
    SublayerOutRms,
)

__all__ = ["QUANTITY_SETS", "REGISTRY", "reference", "resolve_quantities"]


REGISTRY: dict[str, Quantity] = {
    q.name: q for q in (
        ActGradNorm(), ActNorm(), ParamGradNorm(), LnGain(),
        Logged("loss", "the training loss the loop logs (rec.log('loss', loss)); micro-batches: their mean", "loss"),
        Lr(), NonFinite(), WOverSigma(), Cosine(), DlclWeight(), ScaleNormG(), UpdateRatio(),
        Logged("val_loss", "the validation loss the loop logs (rec.log('val_loss', v, step=...))"),
        AttnLogitMax(), AttnEntropy(), AttnSinkMass(), AttnSoftcapSaturation(),
        OutputLogitLogZ(), OutputLogitLogZMax(), SublayerOutRms(), GradRmsOverEps(),
        Spike(), Replay(), *ROUTING, *EXPERTS,
        ActAbsMax(), ActKurtosis(), MassiveActCount(),
        ParamNorm(), ParamRms(), UpdateRms(), AdamVSqrtMean(), AdamVSqrtMax(), SpectralNorm(), StableRank(),
    )
}
"""Quantity name -> the built-in quantity. The one source of the quantity names, presets,
rank rules and spike watch; ``nonfinite_grad`` rows come with ``nonfinite``."""

QUANTITY_NAMES: tuple[str, ...] = tuple(n for q in REGISTRY.values() for n in q.names)
"""Every ``quantity`` value a built-in quantity writes."""

# -- the quantities a Recorder takes ------------------------------------------------------------
DEFAULT_QUANTITIES = ("act_grad_norm", "act_norm", "param_grad_norm", "ln_gain", "loss", "lr", "nonfinite")
ROUTING_QUANTITIES = tuple(q.name for q in ROUTING)  # MoE routing per layer (gradscope.recorder.quantities.moe)
MOE_QUANTITIES = ROUTING_QUANTITIES + tuple(q.name for q in EXPERTS)  # and per-expert norms (a pass over the experts)
ALL_QUANTITIES = DEFAULT_QUANTITIES + ("ln_w_over_sigma", "cosine", "dlcl_weight", "scalenorm_g", "update_ratio", "spike",
                                       *ROUTING_QUANTITIES)
# signals before instability (gradscope.recorder.capture.signals)
SIGNAL_QUANTITIES = ("attn_logit_max", "attn_entropy", "attn_sink_mass", "attn_softcap_saturation", "output_logit_log_z",
                     "output_logit_log_z_max", "sublayer_out_rms", "grad_rms_over_eps")
OUTLIER_QUANTITIES = ("act_abs_max", "act_kurtosis", "massive_act_count")  # gradscope.recorder.quantities.outliers
WEIGHT_QUANTITIES = ("param_norm", "param_rms", "update_rms", "adam_v_sqrt_mean", "adam_v_sqrt_max", "spectral_norm",
                     "stable_rank")  # gradscope.recorder.quantities.weights
# "all" (snapshot's default) costs about what it did: of the new sets it takes only the MoE routing quantities
# (+3 % of a step, on MoE models only). The outliers would double a step at d=256 (massive_act_count's median),
# param_norm adds an all_reduce per recorded step under FSDP2, spectral_norm's estimate depends on the slow steps
# before it (a replayed step would read another value), and the per-expert norms are a pass over the experts.
QUANTITY_SETS: dict[str, tuple[str, ...]] = {"default": DEFAULT_QUANTITIES, "all": ALL_QUANTITIES,
                                       "signals": DEFAULT_QUANTITIES + SIGNAL_QUANTITIES,
                                       "outliers": DEFAULT_QUANTITIES + OUTLIER_QUANTITIES,
                                       "weights": DEFAULT_QUANTITIES + WEIGHT_QUANTITIES,
                                       "moe": DEFAULT_QUANTITIES + MOE_QUANTITIES}


def resolve_quantities(quantities: str | tuple | list) -> dict[str, Quantity]:
    """The Recorder's quantities, by name: a preset (:data:`QUANTITY_SETS`)
    or a list of built-in names (:data:`REGISTRY`) and :class:`Quantity` instances.

    Raises:
        ValueError: an unknown preset or name (the message lists the valid ones), a name
            that only comes with another quantity (``nonfinite_grad``), two quantities of
            one name, or a user quantity that breaks the contract.
    """
    if isinstance(quantities, str):
        if quantities not in QUANTITY_SETS:
            raise ValueError(f"quantities: unknown preset {quantities!r}; valid: {sorted(QUANTITY_SETS)} or a list of "
                             f"{list(REGISTRY)} and gradscope.Quantity instances")
        quantities = QUANTITY_SETS[quantities]
    if not isinstance(quantities, (tuple, list)):
        raise ValueError(f"quantities: a preset {sorted(QUANTITY_SETS)} or a list of names from {sorted(REGISTRY)} and "
                         f"gradscope.Quantity instances; got {quantities!r}")
    if not quantities:
        raise ValueError(f"quantities: an empty list; give a preset ({sorted(QUANTITY_SETS)}) or names from {sorted(REGISTRY)}")
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
