"""``gradscope.compile_audit``: one batch eager and compiled on the same weights, compared site by
site (the module is named ``compiled_vs_eager`` so that the exported function does not hide it).

A miscompile that gives silently wrong gradients (pytorch#193061 was seen only as a
staircase in the total gradient norm) shows up here as the first site whose activation norm,
activation-gradient norm or parameter-group gradient norm differs between the two passes.

How the two passes are made alike:

- **Same weights, no copy.** The compiled pass runs ``torch.compile(model)``, a wrapper
  around the model itself (the same parameters and buffers); a deep copy would double the
  memory and could not share a parameter's identity with the optimizer's or the user's. The
  model is not changed: its parameters' ``.grad`` are put back afterwards, its buffers (a
  BatchNorm's running statistics) are restored after each pass, and its train/eval mode stays.
- **Same randomness.** Both passes start from the same global RNG state (CPU and CUDA,
  ``torch.random.fork_rng``, so the caller's RNG is left as it was), and Inductor is told
  to draw its random numbers as eager does (``torch._inductor.config.fallback_random``),
  so dropout in training mode draws the same masks in both passes.
- **Same recorder.** One :class:`~gradscope.recorder.Recorder` records both passes (step 0
  eager, step 1 compiled), so the compiled graph holds the recorder's taps; a miscompile
  that depends on the graph's exact form may look different in a graph without them.

Order: a divergence in the forward makes every later activation and every gradient differ,
so the cause is the first divergent value in the order the computation produces them:
``act_norm`` (and the loss) in forward order, then ``act_grad_norm`` in backward order (the
reverse of forward order: the order gradients arrive), then ``param_grad_norm`` per group in
backward order. Forward order is that in which the eager pass calls the sites' modules
(taken by hooks removed before the compiled pass); a site whose module no hook saw comes
after those, in the recorder's table order.

Tolerance: relative difference |compiled − eager| / max(|eager|, |compiled|). The default,
:data:`DEFAULT_TOLERANCE`, is 1e-3 for 32- and 64-bit parameters (reassociation and fused
reductions move fp32 values by ~1e-7 relative: at most 1.7e-7 measured on HF GPT-2 and
Llama, d=128, 4 layers, on the CPU; a gradient bug worth finding is 1e-2 or more) and 5e-2
for 16-bit ones (bf16 keeps 8 bits: one rounding is 4e-3, and Inductor's fused kernels skip
intermediate roundings that eager makes; 6.5e-3 measured on that GPT-2 in bf16).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch import nn

from gradscope.recorder import Recorder
from gradscope.recorder.quantities.registry import QUANTITY_SETS

DEFAULT_TOLERANCE = {torch.float64: 1e-3, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 5e-2}
"""Relative difference past which a value counts as divergent, by the model's parameter dtype."""

AUDITED = ("act_norm", "act_grad_norm", "param_grad_norm")
"""The quantities the audit records unless told otherwise."""

PHASES = {"act_norm": "forward", "loss": "forward", "act_grad_norm": "backward", "param_grad_norm": "parameter gradient"}
"""Phase of each quantity, the order of the search for the first divergence (other quantities: "other", last)."""


@dataclass(frozen=True)
class Divergence:
    """The first value past the tolerance, in the order the computation produces them.

    Attributes:
        site: the site (or parameter group; "" is the whole model).
        quantity: ``act_norm``, ``loss``, ``act_grad_norm``, ``param_grad_norm`` or another audited quantity.
        phase: ``forward``, ``backward``, ``parameter gradient`` or ``other``.
        eager: the eager value.
        compiled: the compiled value.
        rel_diff: their relative difference.
    """

    site: str
    quantity: str
    phase: str
    eager: float
    compiled: float
    rel_diff: float

    def __str__(self) -> str:
        return (f"first divergence: {self.quantity} at {self.site or '(whole model)'!r} ({self.phase}): eager "
                f"{self.eager:.6g}, compiled {self.compiled:.6g}, relative difference {self.rel_diff:.3g}")


@dataclass(frozen=True)
class CompileAudit:
    """What :func:`compile_audit` found.

    Attributes:
        table: one row per (site, quantity, layer_j): ``order`` (position in the computation
            order, the search order), ``phase``, ``site``, ``quantity``, ``layer_j``, ``role``,
            ``eager``, ``compiled``, ``rel_diff``, ``past`` (rel_diff > tolerance); sorted by order.
        tolerance: the relative tolerance used.
        first: the first divergent value, or None when every value is within the tolerance.
        recorded: the recorder's tidy table of both passes (step 0 eager, step 1 compiled).
    """

    table: pd.DataFrame
    tolerance: float
    first: Divergence | None
    recorded: pd.DataFrame

    @property
    def passed(self) -> bool:
        """Whether every compared value is within the tolerance."""
        return self.first is None

    def summary(self) -> str:
        """A few lines: the verdict, the largest differences per phase."""
        lines = [str(self.first) if self.first else f"no divergence: every value within {self.tolerance:g} relative"]
        for phase, rows in self.table.groupby("phase", sort=False):
            top = rows.loc[rows.rel_diff.idxmax()]
            lines.append(f"{phase}: {len(rows)} values, {int(rows.past.sum())} past {self.tolerance:g}, largest "
                         f"{top.rel_diff:.3g} ({top.quantity} at {top.site or '(whole model)'!r})")
        return "\n".join(lines)

    def figure(self, ax=None, *, title: str | None = None):
        """The relative difference of every value in computation order, the tolerance and the
        first divergence marked (:func:`gradscope.plots.compile_audit_profile`); returns the Axes."""
        from gradscope.plots.compile_audit import compile_audit_profile

        return compile_audit_profile(self.table, tolerance=self.tolerance, first=self.first, ax=ax, title=title)


def compile_audit(model: nn.Module, batch, loss_fn: Callable, *, tolerance: float | None = None,
                  quantities: Sequence[str] = AUDITED, compile_fn: Callable[[nn.Module], Callable] | None = None
                  ) -> CompileAudit:
    """Runs one batch eagerly and compiled on the same weights and compares every site.

    Args:
        model: the model, not compiled (a ``torch.compile(model)`` wrapper is unwrapped to the
            module inside it); left as it was: parameters, their ``.grad``, buffers, mode, RNG.
        batch: the model's inputs: a tensor, a tuple of positional inputs, or a dict of keyword inputs.
        loss_fn: ``loss_fn(output) -> scalar loss``.
        tolerance: relative difference past which a value diverges; default
            :data:`DEFAULT_TOLERANCE` for the dtype of the model's parameters (1e-3 in fp32).
        quantities: Recorder quantities to compare, names or a preset such as ``"signals"``
            (default ``act_norm``, ``act_grad_norm``, ``param_grad_norm``; the loss is always compared).
        compile_fn: makes the compiled callable from the model (default ``torch.compile``);
            e.g. ``lambda m: torch.compile(m, mode="max-autotune")``. It must not change the model.

    Returns:
        A :class:`CompileAudit`: the per-site table, the first divergence (or None) and ``.figure()``.

    Raises:
        ValueError: a tolerance that is not a positive number, a model without parameters, or
            one with modules compiled in place (``Module.compile()``: its eager pass would be compiled).
    """
    import torch._inductor.config  # (the compiled pass draws random numbers as eager does)

    model = getattr(model, "_orig_mod", model) if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else model
    compiled_in_place = [n or "(the model)" for n, m in model.named_modules()
                         if getattr(m, "_compiled_call_impl", None) is not None]
    if compiled_in_place:
        raise ValueError(f"model: {compiled_in_place[:4]} were compiled in place (Module.compile()), so the eager pass "
                         "would run compiled; audit a model built without .compile() (compile_fn compiles it)")
    if isinstance(quantities, str):
        quantities = QUANTITY_SETS.get(quantities, (quantities,))
    params = list(model.parameters())
    if not params:
        raise ValueError("model: it has no parameters, so there are no weights to compare the passes on")
    if tolerance is None:
        tolerance = DEFAULT_TOLERANCE.get(params[0].dtype, 1e-3)
    if not (isinstance(tolerance, (int, float)) and tolerance > 0 and math.isfinite(tolerance)):
        raise ValueError(f"tolerance: a positive relative difference such as 1e-3; got {tolerance!r}")
    compile_fn = compile_fn or torch.compile
    run = _call(batch)
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    grads = {p: p.grad for p in params}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    rec = Recorder(model, quantities=[*dict.fromkeys([*quantities, "loss"])])
    try:
        with torch.random.fork_rng(devices=devices):
            rng = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]
            with _ForwardOrder(model) as order:
                _pass(rec, 0, lambda: run(model), loss_fn, params)
            _restore(model, buffers, rng, devices)
            compiled = compile_fn(model)
            with torch._inductor.config.patch(fallback_random=True):
                _pass(rec, 1, lambda: run(compiled), loss_fn, params)
        recorded = rec.frame()
    finally:
        rec.close()
        _restore(model, buffers, None, devices)
        for p, g in grads.items():
            p.grad = g
    table = _compare(recorded, order.ranks, tolerance)
    past = table[table.past]
    at = None if past.empty else past.iloc[0]
    first = None if at is None else Divergence(str(at.site), str(at.quantity), str(at.phase), _float(at.eager),
                                               _float(at.compiled), float(at.rel_diff))
    return CompileAudit(table, float(tolerance), first, recorded)


def _float(value) -> float:
    """A table cell as a float (NaN for a value one pass did not record)."""
    return math.nan if pd.isna(value) else float(value)


def _call(batch) -> Callable:
    if isinstance(batch, dict):
        return lambda f: f(**batch)
    if isinstance(batch, (tuple, list)):
        return lambda f: f(*batch)
    return lambda f: f(batch)


def _pass(rec: Recorder, step: int, forward: Callable, loss_fn: Callable, params: list) -> None:
    for p in params:
        p.grad = None
    with rec.step(step):
        loss = loss_fn(forward())
        loss.backward()
        rec.log("loss", loss)


def _restore(model: nn.Module, buffers: dict, rng, devices: list[int]) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers and b.shape == buffers[name].shape:
                b.copy_(buffers[name])
    if rng is not None:
        torch.set_rng_state(rng[0])
        for d, state in zip(devices, rng[1]):
            torch.cuda.set_rng_state(state, d)


class _ForwardOrder:
    """Hooks on every module for one eager forward: the order in which each module's input
    (``<name>.in``) and output (``<name>.out``, and ``<name>``) appear. Removed on exit."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.ranks, self._handles = model, {}, []

    def __enter__(self) -> _ForwardOrder:
        for name, m in self.model.named_modules():
            self._handles.append(m.register_forward_pre_hook(lambda mod, args, n=name: self._see(f"{n}.in")))
            self._handles.append(m.register_forward_hook(lambda mod, args, out, n=name: self._see(n, f"{n}.out")))
        return self

    def _see(self, *names: str) -> None:
        for n in names:
            self.ranks.setdefault(n, len(self.ranks))

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


def _compare(recorded: pd.DataFrame, ranks: dict[str, int], tolerance: float) -> pd.DataFrame:
    """Eager (step 0) against compiled (step 1) per (site, quantity, layer_j), in computation order."""
    rows = recorded[recorded.micro_step == -1]
    key = ["site", "quantity", "layer_j"]
    eager = rows[rows.step == 0].set_index(key)
    compiled = rows[rows.step == 1].set_index(key)
    both = eager[["value", "role"]].rename(columns={"value": "eager"}).join(
        compiled[["value"]].rename(columns={"value": "compiled"}), how="outer").reset_index()
    e, c = both.eager.to_numpy(dtype=float, na_value=math.nan), both.compiled.to_numpy(dtype=float, na_value=math.nan)
    scale = np.fmax(np.abs(e), np.abs(c))
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.abs(c - e) / np.where(scale > 0, scale, 1.0)
    rel = np.where(np.isnan(e) & np.isnan(c), 0.0, np.where(np.isnan(rel), math.inf, rel))  # (one pass's NaN: inf)
    both["rel_diff"] = rel
    both["phase"] = both.quantity.map(PHASES).fillna("other").astype(object)
    sites = both.site.astype(object).tolist()
    forward = np.array([ranks.get(s, ranks.get(_module_of(s), math.inf)) for s in sites], dtype=float)
    phase = both.phase.map({"forward": 0, "backward": 1, "parameter gradient": 2}).fillna(3).to_numpy(dtype=float)
    # forward quantities in forward order; gradients in the reverse; a site no hook saw, and the total "", last
    within = np.where(phase == 0, forward, -forward)
    within = np.where(np.isinf(forward) | ((np.array(sites) == "") & (phase > 0)), math.inf, within)
    both = both.iloc[np.lexsort((np.arange(len(both)), within, phase))]
    both.insert(0, "order", range(len(both)))
    both["past"] = both.rel_diff > tolerance
    return both[["order", "phase", "site", "quantity", "layer_j", "role", "eager", "compiled", "rel_diff",
                 "past"]].reset_index(drop=True)


def _module_of(site: str) -> str:
    """A parameter group's module: the group name itself ("0", "transformer.h.1")."""
    return site.rsplit(".", 1)[0] if site.endswith((".in", ".out")) else site
