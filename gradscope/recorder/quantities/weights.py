"""Weight-side statistics (the set ``"weights"``, issue 52): ``param_norm`` and ``param_rms``
per parameter group, ``update_rms`` of the applied update, Adam's second moment
(``adam_v_sqrt_mean``, ``adam_v_sqrt_max``), and, on the slow schedule, ``spectral_norm``
and ``stable_rank`` of every 2-D weight matrix.

Parameter groups are ``param_grad_norm``'s (every parameter in exactly one leaf group, site
``""`` the total). Why these: weight-norm growth precedes instability (marin#1570,
Lightning#20190), update size against weight size is the usual learning-rate diagnostic,
and √v is the per-coordinate scale Adam divides by (Levanter and Composer log it).

Distributed: norms of DTensor (FSDP2) parameters are summed over the mesh as
``param_grad_norm``'s are, so ``param_norm``, ``param_rms`` and ``update_rms`` are global
on every rank (``shared``); the Adam statistics and the power iteration leave sharded
DTensors out, with a warning (a shard's moments or singular values are not the tensor's).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch

from gradscope.recorder.capture.optimizer_step import Update, stepping_optimizer
from gradscope.recorder.capture.params import is_dtensor
from gradscope.recorder.numerics.spectral import spectral_norm_estimate
from gradscope.recorder.quantities.quantity import Quantity
from gradscope.recorder.quantities.signal_quantities import position
from gradscope.table.keys import Key


def _sizes(ctx) -> np.ndarray:
    """Elements per parameter group (global sizes for DTensors), once per step."""
    return ctx.once("group_sizes", lambda: ctx.groups.host_sums([p.numel() for p in ctx.groups.params]))


def _param_norms(ctx) -> torch.Tensor:
    """‖θ‖ per parameter group, once per step."""
    return ctx.once("param_norms", lambda: ctx.groups.group_norms([p.detach() for p in ctx.groups.params]))


class ParamNorm(Quantity):
    """‖θ‖₂ per parameter group and in total (site ``""``), read when the step ends, before
    the loop's ``optimizer.step()``."""

    name, across_ranks = "param_norm", "shared"
    description = "‖θ‖₂ per parameter group (param_grad_norm's groups) and in total (site \"\"), before optimizer.step()"
    paper = "marin#1570 (weight-norm growth before instability)"

    def collect(self, ctx):
        norms, sizes = _param_norms(ctx), _sizes(ctx)
        if norms is not None:
            _add_populated(ctx, self.name, norms, sizes)


class ParamRms(ParamNorm):
    """‖θ‖₂ / √n per parameter group (n its elements): the typical weight's size."""

    name = "param_rms"
    description = "RMS of the weights, ‖θ‖₂/√n, per parameter group and in total"

    def collect(self, ctx):
        norms, sizes = _param_norms(ctx), _sizes(ctx)
        if norms is not None:
            _add_populated(ctx, self.name, norms / torch.tensor(np.sqrt(np.maximum(sizes, 1)), dtype=norms.dtype,
                                                                device=norms.device), sizes)


def _add_populated(ctx, name: str, values: torch.Tensor, sizes: np.ndarray) -> None:
    """Adds one value per group that has parameters."""
    keys = ctx.groups.keys(name)
    at = np.flatnonzero(sizes > 0)
    if len(at) == len(keys):
        ctx.add_many(keys, values)
    else:
        ctx.add_many([keys[i] for i in at.tolist()], values[torch.as_tensor(at, device=values.device)])


class UpdateRms(Quantity):
    """RMS of the applied update, ‖θ_{t+1} − θ_t‖₂ / √n per parameter group, measured around
    ``optimizer.step()`` by the same hooks as ``update_ratio`` (and on its schedule)."""

    name, slow, across_ranks = "update_rms", True, "shared"
    description = ("RMS of the applied update ‖θ_{t+1} − θ_t‖₂/√n per parameter group across optimizer.step() "
                   "(needs Recorder(optimizer=...))")
    paper = "Lightning#20190; Wortsman et al. 2023 §3.4 (update size)"

    def rows(self, data):
        return []  # made after optimizer.step(), by update_rows

    def update_rows(self, update: Update, warn: Callable[[str, str], None]) -> tuple[list[Key], np.ndarray]:
        """One row per group with parameters that the optimizer steps (a group holding
        parameters another optimizer steps has none, and a warning names it once)."""
        sizes = update.sizes if update.sizes is not None else np.ones(len(update.keys))
        defined = (sizes > 0) & ~update.elsewhere
        if update.elsewhere.any():
            warn("update_rms_other_optimizer", f"update_rms: group(s) {[k.site for k, e in zip(update.keys, update.elsewhere) if e][:5]} "
                 "hold trainable parameters that the attached optimizer does not step: no rows for them. Not reported again.")
        keys = [k._replace(quantity=self.name) for k, d in zip(update.keys, defined) if d]
        return keys, update.delta[defined] / np.sqrt(sizes[defined])


class AdamVSqrtMean(Quantity):
    """Mean over a group's elements of √v, Adam's second-moment estimate
    (``optimizer.state[p]["exp_avg_sq"]``, as the optimizer keeps it: no bias correction), read
    when the step ends: the state the previous ``optimizer.step()`` left (none before the first).
    Adam and AdamW keep ``exp_avg_sq``; with another optimizer a warning says so once, and
    there are no rows."""

    name, across_ranks, which = "adam_v_sqrt_mean", "shared", 0
    description = ("mean of √v over a parameter group, v = Adam's exp_avg_sq in optimizer.state (no bias correction), "
                   "as the previous optimizer.step() left it (needs Recorder(optimizer=...))")
    paper = "Kingma & Ba 2015 (v); Levanter's and Composer's optimizer monitors"

    def collect(self, ctx):
        stats = _adam_v_stats(ctx)
        if stats is not None:
            keys, values = stats
            ctx.add_many([k._replace(quantity=self.name) for k in keys], values[self.which])


class AdamVSqrtMax(AdamVSqrtMean):
    """Max over a group's elements of √v (see :class:`AdamVSqrtMean`)."""

    name, which = "adam_v_sqrt_max", 1
    description = "max of √v over a parameter group, v = Adam's exp_avg_sq (see adam_v_sqrt_mean)"


def _adam_v_stats(ctx) -> tuple[list[Key], torch.Tensor] | None:
    """(keys of the groups with state, (2, groups) mean and max of √v), once per step; None
    when there is nothing to read (no optimizer, no state yet, not an Adam)."""
    return ctx.once("adam_v", lambda: _read_adam_v(ctx))


def _read_adam_v(ctx) -> tuple[list[Key], torch.Tensor] | None:
    opt = stepping_optimizer(ctx.optimizer) if ctx.optimizer is not None else None
    if opt is None:  # (as update_ratio: no optimizer given, no rows; the description says it needs one)
        return None
    params = ctx.groups.params
    states = [opt.state.get(p) for p in params]
    if not any(states):
        return None  # (before the first optimizer.step(): nothing yet)
    v = [s.get("exp_avg_sq") if s else None for s in states]
    if all(x is None for x in v):
        ctx.warn_once("adam_v_not_adam", f"adam_v_sqrt_mean/max: {type(opt).__name__} keeps no exp_avg_sq (Adam's and "
                      "AdamW's second moment) in its state: no rows")
        return None
    sharded = [n for n, x in zip(ctx.groups.names, v) if x is not None and is_dtensor(x)]
    if sharded:
        ctx.warn_once("adam_v_sharded", f"adam_v_sqrt_mean/max: the state of {sharded[:3]} is sharded (DTensor): "
                      "left out of their groups (a shard's √v is not the tensor's)")
        v = [None if x is not None and is_dtensor(x) else x for x in v]
    present = [i for i, x in enumerate(v) if x is not None]
    if not present:
        return None
    counts = np.zeros(len(params))
    counts[present] = [v[i].numel() for i in present]
    sizes = ctx.groups.host_sums(counts)
    device = v[present[0]].device
    roots = [v[i].detach().float().sqrt() for i in present]
    per = torch.stack([torch.stack([r.sum() for r in roots]), torch.stack([r.amax() for r in roots])])  # (2, present)
    full = torch.zeros(2, len(params), device=device)
    full[:, torch.tensor(present, device=device)] = per
    member = ctx.groups.membership(device)  # (groups, params)
    mean = (member @ full[0]) / torch.tensor(np.maximum(sizes, 1), dtype=torch.float32, device=device)
    largest = (member * full[1]).amax(dim=1)  # (√v ≥ 0: a non-member's 0 never wins)
    at = np.flatnonzero(sizes > 0)
    keys = ctx.groups.keys("adam_v")
    return [keys[i] for i in at.tolist()], torch.stack([mean, largest])[:, torch.as_tensor(at, device=device)]


class SpectralNorm(Quantity):
    """σ₁ = ‖W‖₂ of every 2-D parameter (site: the parameter's name), by power iteration
    warm-started from the last slow step's vector (:mod:`gradscope.recorder.numerics.spectral`):
    :attr:`iterations` iterations per slow step, so the estimate (a lower bound) converges over
    the first few slow steps and then follows the weights. Per matrix rather than per group:
    a group's matrices have no joint spectral norm. Sharded DTensor weights are left out, with
    a warning."""

    name, slow, across_ranks = "spectral_norm", True, "shared"
    description = ("largest singular value ‖W‖₂ of every 2-D parameter, by power iteration with its vector kept "
                   "across slow steps (a lower bound, converging)")
    paper = "Miyato et al. 2018 (power iteration); Yang et al. 2023 (spectral condition)"
    iterations = 4  # power iterations per slow step (each: two matrix-vector products)

    def collect(self, ctx):
        keys, sigma, _ = _spectra(ctx, self.iterations)
        if keys:
            ctx.add_many([k._replace(quantity=self.name) for k in keys], sigma)


class StableRank(SpectralNorm):
    """‖W‖_F² / ‖W‖₂² of every 2-D parameter (Rudelson & Vershynin 2007), with ‖W‖₂ the power
    iteration's estimate (:class:`SpectralNorm`), so at least the true stable rank."""

    name = "stable_rank"
    description = "stable rank ‖W‖_F²/‖W‖₂² of every 2-D parameter (‖W‖₂ from spectral_norm's power iteration)"
    paper = "Rudelson & Vershynin 2007"

    def collect(self, ctx):
        keys, sigma, frobenius_sq = _spectra(ctx, self.iterations)
        if keys:
            ctx.add_many([k._replace(quantity=self.name) for k in keys], frobenius_sq / sigma.square())


_VECTORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""A Recorder's capture -> parameter name -> the power iteration's right singular vector."""


def _spectra(ctx, iterations: int) -> tuple[list[Key], torch.Tensor | None, torch.Tensor | None]:
    """(keys, σ̂, ‖W‖_F²) of the 2-D parameters, once per step (spectral_norm and stable_rank share it)."""
    if "spectra" in ctx._cache:
        return ctx._cache["spectra"]
    keys, sigmas, squares, sharded = [], [], [], []
    vectors = _VECTORS.setdefault(ctx.capture, {})  # (this Recorder's: its capture lives as long as it)
    for name, p in zip(ctx.groups.names, ctx.groups.params):
        if p.dim() != 2:
            continue
        w = p.detach()
        if is_dtensor(w):
            if not all(pl.is_replicate() for pl in w.placements):
                sharded.append(name)
                continue
            w = w.to_local()
        owner = name.rpartition(".")[0]
        stack, layer = position(ctx.layout, owner)
        keys.append(Key(-1, stack, layer, name, "spectral_norm", None, ""))
        sigmas.append(spectral_norm_estimate(vectors, name, w, iterations))
        squares.append(w.float().square().sum())
    if sharded:
        ctx.warn_once("spectral_sharded", f"spectral_norm/stable_rank: {sharded[:3]} are sharded DTensors, left out "
                      "(power iteration on a shard is not the matrix's)")
    out = (keys, torch.stack(sigmas), torch.stack(squares)) if keys else ([], None, None)
    ctx._cache["spectra"] = out
    return out
