"""The built-in quantities, one class each (the contract: :mod:`.quantity`). The registry
that lists them is :mod:`.registry`."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from gradscope.recorder.capture.optimizer_step import Update

from gradscope.recorder.quantities.combine import ratio
from gradscope.recorder.quantities.quantity import Quantity
from gradscope.recorder.quantities.step_data import call_name
from gradscope.table.keys import Key


class ActNorm(Quantity):
    """‖h‖₂ of a site's forward value; several forwards of one micro-step count together
    (√Σ‖h_f‖², their batches taken as one), and the accumulated row is the norm over all
    micro-batches."""

    name, captures = "act_norm", frozenset({"value"})
    description = "‖h‖₂ of the tensor crossing a site (the step's row: over all micro-batches)"
    across_ranks = "rss"

    def nothing_to_measure(self, layout):
        return _no_sites(layout)

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

    def nothing_to_measure(self, layout):
        return _no_sites(layout)

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
    order of appearance (forward order; backward runs in reverse), value 0 first; under
    gradient accumulation per micro-step, and for the step in order of first appearance
    (micro-step, then order)."""

    name, captures, also_names = "nonfinite", frozenset({"value", "grad"}), ("nonfinite_grad",)
    description = ("sites whose forward value (nonfinite) or gradient (nonfinite_grad) held a NaN/Inf; "
                   "value = order of appearance, 0 first")

    def rows(self, data):
        out = []
        if np.isfinite(data.value).all() and np.isfinite(data.grad_sq).all():
            return out
        first: dict[str, dict] = {"nonfinite": {}, "nonfinite_grad": {}}  # site -> (micro-step, order), its first
        for m in range(data.micro_steps):
            fwd, bwd = [], []
            for p, c, slot, site in data.slot_sites():
                order = abs(data.order[m, slot])
                if order and not math.isfinite(data.value[m, slot]):
                    fwd.append((order, p, site))
                if not math.isfinite(data.grad_sq[m, slot]):
                    bwd.append((-order, p, site))
            for quantity, found in (("nonfinite", fwd), ("nonfinite_grad", bwd)):
                for rank, (order, p, site) in enumerate(sorted(found, key=lambda f: f[0])):
                    out.append((Key(data.micro(m), p.stack, p.layer, site, quantity, None, p.role), float(rank)))
                    first[quantity].setdefault(site, (m, order, p))
        if data.micro_steps > 1:  # the step's rows: every site that held one, in order of first appearance
            for quantity, seen in first.items():
                for rank, (site, (_, _, p)) in enumerate(sorted(seen.items(), key=lambda s: s[1][:2])):
                    out.append((Key(-1, p.stack, p.layer, site, quantity, None, p.role), float(rank)))
        return out


class LnGain(Quantity):
    """‖grad at the norm's input through the norm alone‖ / ‖grad at its output‖ (Takase §3):
    the factor by which backward through that norm scales the gradient."""

    name, captures, needs_backward = "ln_gain", frozenset({"grad"}), True
    description = "‖gradient at a norm's input, through the norm alone‖ / ‖gradient at its output‖"
    paper = "Takase et al. 2022, §3"

    def nothing_to_measure(self, layout):
        names = set(layout.site_names())
        if any(n.site_in in names and n.site_out in names for n in layout.norms):
            return None
        return ("the model has no normalisation layer the recorder reads" if not layout.norms
                else "no normalisation layer has both its input and output sites recorded (sites=)")

    def rows(self, data):
        index = {p.name: i for i, p in enumerate(data.sites)}
        norms = [n for n in data.layout.norms if n.site_in in index and n.site_out in index and n.name not in data.grad_left_out]
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

    def nothing_to_measure(self, layout):
        return None if layout.norms else "the model has no normalisation layer the recorder reads"

    def rows(self, data):
        out = []
        base = len(data.sites) * data.K
        read = [(j, norm) for j, norm in enumerate(data.layout.norms) if norm.name not in data.unfit]
        if data.micro_steps == 1 and read:  # (every norm at once: the loop's rows, in its order)
            slots = (base + np.array([j for j, _ in read])[:, None] * data.K + np.arange(data.K)).ravel()
            at = np.flatnonzero(data.order[0, slots] != 0)  # norm by norm, call by call
            keys = data.kept_keys((self.name, tuple(at.tolist()), tuple(n.name for _, n in read)), lambda: [
                Key(-1, n.stack, n.layer, call_name(n.name, a % data.K), self.name, None, "")
                for a in at.tolist() for n in (read[a // data.K][1],)])
            return list(zip(keys, data.value[0, slots[at]].tolist()))
        for j, norm in read:
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

    def nothing_to_measure(self, layout):
        return None if layout.stacks else "the recorder found no stack of layers of one class in the model"

    def collect(self, ctx):
        for stack, (matrix, written) in ctx.cosine_matrices().items():
            site = stack if ctx.layout.foreign else f"{stack}.layers"  # the layer list's module name
            ctx.add_matrix(stack, site, self.name, matrix)
            ctx.add_block(f"cosine_written:{stack}", written)

    def rows(self, data):
        complete = {k.split(":", 1)[1] for k, w in data.blocks.items() if k.startswith("cosine_written:") and w.all()}
        return [r for r in data.collected.get(self.name, []) if r[0].stack in complete]


class ParamGradNorm(Quantity):
    """‖grad‖ of parameters per layer, per sub-layer, per embedding, and in total (site "")."""

    name, needs_backward, reads_param_grads = "param_grad_norm", True, True
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

    def nothing_to_measure(self, layout):
        return None if layout.mixers else "the model has no DLCL layer combination or transparent attention"

    def collect(self, ctx):
        for name, mixer in ctx.layout.mixers.items():
            stack = name.split(".")[0] if name.startswith(("encoder", "decoder")) else ""
            ctx.add_matrix(stack, name, self.name, mixer.mixing_weights())

    def rows(self, data):
        return [r for r in data.collected.get(self.name, [])
                if not (r[0].site.endswith("combine") and r[0].layer_j > r[0].layer)]


class ScaleNormG(Quantity):
    """The learned g of every ScaleNorm (Nguyen & Salazar 2019)."""

    name, across_ranks = "scalenorm_g", "shared"
    description = "the learned scale g of every ScaleNorm"
    paper = "Nguyen & Salazar 2019"

    def nothing_to_measure(self, layout):
        if any(isinstance(getattr(n.module, "g", None), torch.Tensor) and n.module.g.dim() == 0 for n in layout.norms):
            return None
        return "the model has no ScaleNorm (a norm with a learned scalar g)"

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


class LrSource:
    """Where one Recorder's ``lr`` comes from: the optimizer given to the constructor, or the
    loop's own ``rec.log("lr", ...)``; warns (once) when ``lr``, asked for by name, has
    neither. The warning waits for the second recorded step's end or ``close()``, so that a
    value logged after the first step (``rec.log("lr", v, step=s)``) counts.

    Args:
        from_optimizer: whether the Recorder was given the optimizer (``Lr.collect`` reads it).
        asked: whether ``lr`` was asked for by name (not only as part of a set).
    """

    def __init__(self, *, from_optimizer: bool, asked: bool) -> None:
        self.from_optimizer, self.asked = from_optimizer, asked
        self.logged = False  # the loop logged lr itself
        self._checks = 0

    def log(self, quantity: str) -> None:
        """The loop logged ``quantity``."""
        self.logged = self.logged or quantity == "lr"

    def step_ended(self, wants: set[str], optimizer, warn_once) -> None:
        """A recorded step that took ``wants`` ended, with ``optimizer`` attached (or None)."""
        if "lr" in wants and optimizer is None and self.asked:
            self.check(warn_once)

    def closing(self, optimizer, warn_once) -> None:
        """The Recorder closes."""
        if self._checks and optimizer is None:
            self.check(warn_once, closing=True)

    def check(self, warn_once, *, closing: bool = False) -> None:
        if self.logged:
            return
        self._checks += 1
        if self._checks >= 2 or closing:
            warn_once("lr", "lr is read from the optimizer: give the Recorder the optimizer "
                      "(Recorder(model, optimizer=opt), or rec.attach_optimizer(opt)) or log it yourself "
                      "with rec.log('lr', value); until then it has no rows")


class Logged(Quantity):
    """A scalar the training loop logs itself (``rec.log("loss", loss)``)."""

    logged = True

    def __init__(self, name: str, description: str, across_ranks: str = "local") -> None:
        self.name, self.description, self.across_ranks = name, description, across_ranks


class UpdateRatio(Quantity):
    """‖Δθ‖/‖θ‖ per parameter group around ``optimizer.step()``: measured by the Recorder's
    optimizer hooks (:mod:`gradscope.recorder.capture.optimizer_step`), its rows made by
    :meth:`update_rows` after the step's other rows."""

    name, slow, across_ranks = "update_ratio", True, "shared"
    description = ("‖Δθ‖ / ‖θ‖ per parameter group across optimizer.step() (needs Recorder(optimizer=...)); no "
                   "row for a group whose ‖θ‖ was 0 before the step (a warning)")

    def rows(self, data):
        return []  # made after optimizer.step(), by update_rows

    def update_rows(self, update: Update, warn: Callable[[str, str], None]) -> tuple[list[Key], np.ndarray]:
        """The rows of one measured update: ‖Δθ‖/‖θ‖ of every group with parameters. A group
        whose ‖θ‖ was 0 before the update (weights initialised to zero), or that holds
        trainable parameters the optimizer does not step (their Δθ is not this step's), has
        no row, and a warning names it once."""
        keys, defined = update.keys, update.base > 0
        if update.elsewhere.any():
            warn("update_ratio_other_optimizer", f"update_ratio: group(s) "
                 f"{[k.site for k, e in zip(keys, update.elsewhere) if e][:5]} hold trainable parameters that the "
                 "attached optimizer does not step (a second optimizer?): no rows for them, the total "
                 "included. Not reported again.")
            defined &= ~update.elsewhere
        if not defined.all():
            zero = [k.site for k, b, p in zip(keys, update.base, update.populated) if p and b <= 0]
            if zero:
                warn("update_ratio_zero", f"update_ratio of group(s) {zero[:5]} is undefined at step "
                     f"{update.step}: ‖θ‖ was 0 before the update (weights initialised to zero); no row for "
                     "them while it is. Not reported again.")
            keys = [k for k, d in zip(keys, defined) if d]
        return keys, update.delta[defined] / update.base[defined]


class Spike(Quantity):
    """A value far above its own recent past (:mod:`gradscope.recorder.quantities.spike`); its rows are
    added by the Recorder's outlet as each step's rows pass, from the watched quantities."""

    name = "spike"
    description = ("robust z-score (above 6) of a value's log against the median and MAD of its series' previous "
                   "128 recorded values' logs, for every quantity whose spike_watched is set")
    paper = "OLMo-core's loss-spike window; Hampel 1974 (median/MAD)"

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


def _with_grads(ctx, keys: list, values: torch.Tensor) -> tuple[list, torch.Tensor]:
    """The keys and values of the parameter groups that have a gradient (all, usually)."""
    ok = ctx.groups_with_grads()
    if all(ok):
        return keys, values
    at = [i for i, k in enumerate(ok) if k]
    return [keys[i] for i in at], values[torch.tensor(at, device=values.device)]


def _no_sites(layout) -> str | None:
    """Why a per-site quantity has nothing to measure: no site found (else None)."""
    return None if layout.sites else "the recorder found no site in the model"
