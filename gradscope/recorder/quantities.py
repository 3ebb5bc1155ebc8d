"""Every quantity in one registry (Cockpit style): what it captures, its schedule, its rows.

A quantity class names the in-graph captures it needs (``value``: a site's forward norm;
``grad``: the tap's ‖∂loss/∂h‖²; ``wsig``: a norm's w/σ; ``cosine``: sampled layer-output
rows), whether it is *slow* (taken every ``slow_every`` recorded steps), what it computes on
the device at the end of a step (``collect``), and how the step's host values become table
rows (``rows``). Adding a quantity is one class here plus its name in ``gradscope.table``.

Row keys are ``(micro_step, stack, layer, site, quantity, layer_j, role)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from gradscope.recorder.layout import Layout, Probe
from gradscope.recorder.signal_quantities import (
    AttnEntropy,
    AttnLogitMax,
    GradRmsOverEps,
    OutputLogitLogZ,
    OutputLogitLogZMax,
    SublayerOutRms,
    group_grad_norms,
)
from gradscope.recorder.store import StepBuffer
from gradscope.table import QUANTITIES

Row = tuple[tuple, float]


@dataclass
class StepData:
    """One recorded step on the host, after its single device→host transfer.

    ``grad_sq`` (M, points·K) holds ‖∂loss/∂h‖² per micro-step and slot, already unscaled;
    ``order`` (M, slots) the forward order of each slot's call (+ tapped, − not tapped, 0 not
    called); ``value`` (M, slots) the forward statistic (‖h‖ for sites, w/σ for norms).
    """

    layout: Layout
    points: list[Probe]
    K: int
    grad_sq: np.ndarray
    order: np.ndarray
    value: np.ndarray
    device: dict[str, list[Row]] = field(default_factory=dict)  # rows computed on the device
    blocks: dict[str, np.ndarray] = field(default_factory=dict)  # raw arrays from the device
    unfit: set[str] = field(default_factory=set)  # norms whose output is not g·x̂ + b (adaptive norms)
    no_backward: bool = False  # forward tapped gradients but no backward ran inside the step: no gradient rows
    low_precision: set[str] = field(default_factory=set)  # fitted norms called on bf16/fp16 tensors (also in unfit)

    @property
    def micro_steps(self) -> int:
        return self.grad_sq.shape[0]

    def micro(self, m: int) -> int:
        """The micro_step column for micro-step m (-1 when the step had only one)."""
        return m if self.micro_steps > 1 else -1

    @cached_property
    def got(self) -> np.ndarray:
        """(M, taps) bool: micro-steps in which a slot's value was tapped or its gradient
        arrived (under reentrant checkpointing the tap is in the recompute)."""
        return (self.order[:, : self.grad_sq.shape[1]] > 0) | (self.grad_sq != 0)

    @cached_property
    def _sites(self) -> list[tuple[Probe, int, int, str]]:
        seen = (self.order[:, : self.grad_sq.shape[1]] != 0).any(axis=0) | (self.grad_sq != 0).any(axis=0)
        out = []
        for slot in np.flatnonzero(seen).tolist():
            i, c = divmod(slot, self.K)
            p = self.points[i]
            out.append((p, c, slot, call_name(p.name, c)))
        return out

    def slot_sites(self) -> list[tuple[Probe, int, int, str]]:
        """(point, call, slot, site name) of every (site, call) slot called in the step."""
        return self._sites


def call_name(name: str, call: int) -> str:
    """Site name of the call-th (0-based) call of a module: ``name``, ``name#2``, ..."""
    return name if call == 0 else f"{name}#{call + 1}"


class Quantity:
    """Base class: a quantity with no capture and no rows."""

    name: str = ""
    captures: frozenset[str] = frozenset()
    slow: bool = False
    logged: bool = False  # values come from ``rec.log``, whatever the quantities asked for
    needs_backward: bool = False  # reads gradients: no rows for a step whose backward did not run inside it

    def collect(self, rec, buf: StepBuffer) -> None:
        """Device work at the end of a recorded step (values go into ``buf``)."""

    def rows(self, data: StepData) -> list[Row]:
        """Table rows of the step."""
        return data.device.get(self.name, [])


class ActNorm(Quantity):
    """‖h‖₂ of a site's forward value; the accumulated row is the norm over all micro-batches."""

    name, captures = "act_norm", frozenset({"value"})

    def rows(self, data):
        sites = data.slot_sites()
        slots = [slot for _, _, slot, _ in sites]
        called = data.order[:, slots] != 0  # (M, n)
        value = np.where(called, data.value[:, slots], 0.0)
        total = np.sqrt(np.square(value).sum(axis=0)).tolist()
        out = []
        for j, ((p, _, _, site), any_call) in enumerate(zip(sites, called.any(axis=0).tolist())):
            if not any_call:
                continue
            if data.micro_steps > 1:
                out += [((m, p.stack, p.layer, site, self.name, None, p.role), float(value[m, j]))
                        for m in np.flatnonzero(called[:, j]).tolist()]
            out.append(((-1, p.stack, p.layer, site, self.name, None, p.role), total[j]))
        return out


class ActGradNorm(Quantity):
    """‖∂loss/∂h‖₂ over the whole tensor crossing a site (Takase Fig. 3-4)."""

    name, captures, needs_backward = "act_grad_norm", frozenset({"grad"}), True

    def rows(self, data):
        sites = data.slot_sites()
        slots = [slot for _, _, slot, _ in sites]
        got = data.got[:, slots]
        sq = np.where(got, data.grad_sq[:, slots], 0.0)
        total = np.sqrt(sq.sum(axis=0)).tolist()
        out = []
        for j, ((p, _, _, site), any_grad) in enumerate(zip(sites, got.any(axis=0).tolist())):
            if not any_grad:
                continue
            if data.micro_steps > 1:
                out += [((m, p.stack, p.layer, site, self.name, None, p.role), math.sqrt(sq[m, j]))
                        for m in np.flatnonzero(got[:, j]).tolist()]
            out.append(((-1, p.stack, p.layer, site, self.name, None, p.role), total[j]))
        return out


class NonFinite(Quantity):
    """Sites whose value (``nonfinite``) or gradient (``nonfinite_grad``) held a NaN/Inf, in
    order of appearance (forward order; backward runs in reverse), value 0 first."""

    name, captures = "nonfinite", frozenset({"value", "grad"})

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
                    out.append(((data.micro(m), p.stack, p.layer, site, quantity, None, p.role), float(rank)))
        return out


class LnGain(Quantity):
    """‖grad at the norm's input through the norm alone‖ / ‖grad at its output‖ (Takase §3):
    the factor by which backward through that norm scales the gradient."""

    name, captures, needs_backward = "ln_gain", frozenset({"grad"}), True

    def rows(self, data):
        index = {p.name: i for i, p in enumerate(data.points)}
        calls = np.arange(data.K)
        out = []
        for norm in data.layout.norms:
            if norm.site_in not in index or norm.site_out not in index or norm.name in data.unfit:
                continue
            s_in, s_out = index[norm.site_in] * data.K + calls, index[norm.site_out] * data.K + calls
            got = data.got[:, s_in] & data.got[:, s_out]  # (M, K)
            for c in np.flatnonzero(got.any(axis=0)).tolist():
                g_in, g_out = data.grad_sq[got[:, c], s_in[c]], data.grad_sq[got[:, c], s_out[c]]
                key = (norm.stack, norm.layer, call_name(norm.name, c), self.name, None, "")
                if data.micro_steps > 1:
                    out += [((m, *key), _ratio(math.sqrt(a), math.sqrt(b)))
                            for m, a, b in zip(np.flatnonzero(got[:, c]).tolist(), g_in.tolist(), g_out.tolist())]
                out.append(((-1, *key), _ratio(math.sqrt(g_in.sum()), math.sqrt(g_out.sum()))))
        return out


class WOverSigma(Quantity):
    """mean over tokens and features of w/σ per norm call (Xu 2020 Table 2); the accumulated
    row averages the micro-steps. See :mod:`gradscope.recorder.norm_stats`."""

    name, captures = "ln_w_over_sigma", frozenset({"wsig"})

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
                    out += [((m, *key), v) for m, v in zip(np.flatnonzero(got[:, c]).tolist(), vals.tolist())]
                out.append(((-1, *key), float(vals.mean())))
        return out


class Cosine(Quantity):
    """S[i, j] = mean over sampled non-pad tokens of cos(y_i, y_j), y_0 the embedding (Takase Fig. 5)."""

    name, captures, slow = "cosine", frozenset({"cosine"}), True

    def collect(self, rec, buf):
        for stack, (matrix, written) in rec._capture.cosine.matrices().items():
            site = stack if rec.layout.foreign else f"{stack}.layers"  # the layer list's module name
            buf.add_matrix(-1, stack, site, self.name, matrix)
            buf.add_block(f"cosine_written:{stack}", written)

    def rows(self, data):
        complete = {k.split(":", 1)[1] for k, w in data.blocks.items() if k.startswith("cosine_written:") and w.all()}
        return [r for r in data.device.get(self.name, []) if r[0][1] in complete]


class ParamGradNorm(Quantity):
    """‖grad‖ of parameters per layer, per sub-layer, per embedding, and in total (site "")."""

    name, needs_backward = "param_grad_norm", True

    def collect(self, rec, buf):
        norms = group_grad_norms(rec, buf)
        if norms is not None:
            keys = rec.groups.keys(self.name)
            buf.add_many(keys, norms)


class DlclWeight(Quantity):
    """DLCL W[r, k] (lower triangle) and transparent-attention weights (Wang 2019 Fig. 5)."""

    name = "dlcl_weight"

    def collect(self, rec, buf):
        for name, mixer in rec.layout.mixers.items():
            stack = name.split(".")[0] if name.startswith(("encoder", "decoder")) else ""
            buf.add_matrix(-1, stack, name, self.name, mixer.mixing_weights())

    def rows(self, data):
        return [r for r in data.device.get(self.name, [])
                if not (r[0][3].endswith("combine") and r[0][5] > r[0][2])]


class ScaleNormG(Quantity):
    """The learned g of every ScaleNorm (Nguyen & Salazar 2019)."""

    name = "scalenorm_g"

    def collect(self, rec, buf):
        for norm in rec.layout.norms:
            g = getattr(norm.module, "g", None)
            if isinstance(g, torch.Tensor) and g.dim() == 0:
                buf.add((-1, norm.stack, norm.layer, norm.name, self.name, None, ""), g.detach().float().reshape(()))


class Lr(Quantity):
    """The optimizer's learning rate (first group), when the Recorder was given the optimizer."""

    name = "lr"

    def collect(self, rec, buf):
        if rec._lr_from_optimizer and rec.optimizer is not None:
            buf.add_float((-1, "", None, "", self.name, None, ""), float(rec.optimizer.param_groups[0]["lr"]))


class Logged(Quantity):
    """A scalar the training loop logs itself (``rec.log("loss", loss)``)."""

    logged = True

    def __init__(self, name: str) -> None:
        self.name = name


class UpdateRatio(Quantity):
    """‖Δθ‖/‖θ‖ per parameter group around ``optimizer.step()`` (rows written by the Recorder's
    optimizer hooks, after the step's other rows)."""

    name, slow = "update_ratio", True


REGISTRY: dict[str, Quantity] = {
    q.name: q for q in (
        ActGradNorm(), ActNorm(), ParamGradNorm(), LnGain(), Logged("loss"), Lr(), NonFinite(), WOverSigma(),
        Cosine(), DlclWeight(), ScaleNormG(), UpdateRatio(), Logged("val_loss"),
        AttnLogitMax(), AttnEntropy(), OutputLogitLogZ(), OutputLogitLogZMax(), SublayerOutRms(), GradRmsOverEps(),
    )
}
"""Quantity name -> its class instance. ``nonfinite_grad`` rows come with ``nonfinite``."""


def _ratio(a: float, b: float) -> float:
    return a / b if b != 0 else (math.nan if a == 0 else math.inf)


# -- the quantities a Recorder takes ------------------------------------------------------------
DEFAULT_QUANTITIES = ("act_grad_norm", "act_norm", "param_grad_norm", "ln_gain", "loss", "lr", "nonfinite")
ALL_QUANTITIES = DEFAULT_QUANTITIES + ("ln_w_over_sigma", "cosine", "dlcl_weight", "scalenorm_g", "update_ratio", "spike")
SIGNAL_QUANTITIES = ("attn_logit_max", "attn_entropy", "output_logit_log_z", "output_logit_log_z_max", "sublayer_out_rms",
                     "grad_rms_over_eps")  # signals before instability (gradscope.recorder.signals)
SLOW_QUANTITIES = frozenset(name for name, q in REGISTRY.items() if q.slow)  # every ``slow_every`` recorded steps


def resolve_quantities(quantities: str | tuple | list) -> tuple[str, ...]:
    """``"default"``, ``"all"``, ``"signals"``, or a list of names from ``gradscope.table.QUANTITIES``
    (``spike`` is computed on the host by the Recorder's outlet, :mod:`gradscope.recorder.spike`)."""
    if isinstance(quantities, str):
        presets = {"default": DEFAULT_QUANTITIES, "all": ALL_QUANTITIES, "signals": DEFAULT_QUANTITIES + SIGNAL_QUANTITIES}
        if quantities not in presets:
            raise ValueError(f"quantities: unknown preset {quantities!r}; valid: {sorted(presets)} or a list of {list(QUANTITIES)}")
        return presets[quantities]
    if not isinstance(quantities, (tuple, list)) or not all(isinstance(q, str) for q in quantities):
        raise ValueError(f"quantities: 'default', 'all', 'signals' or a list of names from {sorted(QUANTITIES)}; "
                         f"got {quantities!r}")
    unknown = [q for q in quantities if q not in QUANTITIES]
    if unknown:
        raise ValueError(f"quantities: unknown {unknown}; valid: {sorted(QUANTITIES)}")
    return tuple(quantities)
