"""From a recorded step's host values to table rows: micro-steps, unscaling, quantities.

Runs once per recorded step on the numbers that just reached the host; no device work.
"""

from __future__ import annotations

from array import array

import numpy as np

from gradscope.recorder.capture.buffer_layout import FIRST_USER, MISFIT, ORDER, REACHED, REACHED_IF_TAPPED, VALUE, Arrivals
from gradscope.recorder.numerics.norm_stats import GUESSED, LOW_PRECISION, UNTOLD
from gradscope.recorder.quantities.quantity import Quantity, checked_rows
from gradscope.recorder.quantities.step_data import StepData
from gradscope.table.keys import Key

MISFIT_LIMIT = 1e-9  # a fitted norm whose residual exceeds this share of Var(y) is not of the form g·x̂ + b
# (an exact norm's residual is fp32 rounding, ~1e-14; a DyT norm's or an eps outside the square root, 1e-7
# to 1e-5, already moves the gradient through it by 0.1-0.5 %)

SCALE = "__scale__"


def micro_steps(snapshots: np.ndarray, marks: np.ndarray, reached: np.ndarray, n_collector: int, width: int = FIRST_USER
                ) -> tuple[np.ndarray, ...]:
    """Splits the captured snapshots into micro-steps: the collector's gradient (M, n_collector:
    ‖grad‖² per tap, then the user statistics), whether each tap's gradient arrived (M, taps:
    ``REACHED``, ``REACHED_IF_TAPPED`` or 0), which slots a compiled call marked (M, slots),
    order and value (M, slots), the user
    statistics' forward channels (M, slots, width − FIRST_USER), and each slot's largest norm-fit
    misfit over the step.

    Each snapshot is one backward's collector gradient followed by the forward buffer (eager
    calls' order marks come in ``marks``, as they are kept on the host, and so does
    ``reached``). A snapshot with no forward call since the one before (the inner backward of
    reentrant checkpointing) adds its gradients to that micro-step; a last snapshot with
    neither is dropped.
    """
    grads, fwd = snapshots[:, :n_collector], snapshots[:, n_collector:].reshape(len(snapshots), -1, width).copy()
    traced = fwd[:, :, ORDER] != 0  # compiled calls mark on the device, eager ones on the host (``marks``)
    fwd[:, :, ORDER] += marks
    keep_g, keep_r, keep_t, keep_f, misfit = [], [], [], [], fwd[:, :, MISFIT].max(axis=0)
    for g, r, t, f in zip(grads, reached, traced, fwd):
        called = bool((f[:, ORDER] != 0).any())
        if not called:
            if keep_g:
                keep_g[-1] = keep_g[-1] + g
                keep_r[-1] = np.maximum(keep_r[-1], r)
            continue
        keep_g.append(g.copy())
        keep_r.append(r)
        keep_t.append(t)
        keep_f.append(f)
    if not keep_g:
        n = fwd.shape[1]
        return (np.zeros((0, n_collector)), np.zeros((0, reached.shape[1]), dtype=np.int8), np.zeros((0, n), dtype=bool),
                np.zeros((0, n)), np.zeros((0, n)), np.zeros((0, n, width - FIRST_USER)), misfit)
    f = np.stack(keep_f)
    return np.stack(keep_g), np.stack(keep_r), np.stack(keep_t), f[:, :, ORDER], f[:, :, VALUE], f[:, :, FIRST_USER:], misfit


def host_marks(marks: list[array], arrivals: list[Arrivals], n_taps: int) -> tuple[np.ndarray, np.ndarray]:
    """The snapshots' host marks as arrays: the order marks eager calls set (M, slots), and
    whether each tap's gradient arrived (M, taps: ``REACHED``, ``REACHED_IF_TAPPED`` or 0)."""
    reached = np.empty((len(arrivals), n_taps), dtype=np.int8)
    for row, arrival in zip(reached, arrivals):
        row[:] = arrival.every
        row[arrival.slots] = REACHED
    return np.array([np.frombuffer(m, dtype=np.float64) for m in marks], dtype=np.float64), reached


def step_rows(keys: list, values: np.ndarray, blocks: dict, *, layout, sites, K: int, quantities: dict[str, Quantity],
              wants: set[str], params_unscaled: bool | None, backwards: int = 1, grad_forwards: int = 1,
              forwards: int | None = None, grads_moved: bool | None = None, call_counts: list[int] | None = None,
              value_stats: tuple[str, ...] = (),
              grad_stats: tuple[str, ...] = (), width: int = FIRST_USER, key_cache: dict | None = None,
              closed_form: frozenset[str] = frozenset()
              ) -> tuple[list, np.ndarray, StepData]:
    """The rows of one recorded step, in the order of ``quantities`` (the Recorder's).

    ``value_stats`` / ``grad_stats``: the names of the quantities whose ``site_value`` /
    ``site_grad`` the capture took, in its channel order; ``key_cache``: the Recorder's row
    keys kept from step to step (:meth:`StepData.step_keys`).

    Gradient norms are divided by the GradScaler scale (key ``__scale__``); the values of
    quantities that read ``p.grad`` (``reads_param_grads``) only if the user had not unscaled
    them already. ``backwards``: the backwards the capture
    saw inside the step; when the forward tapped gradients but none came, the quantities
    that read gradients have no rows (their values would be 0.0 or an earlier step's); so too
    when a forward ran but none with grad enabled (``grad_forwards``: an evaluation step
    under ``torch.no_grad``), whose ``p.grad`` would be an earlier step's. A capture that hooks
    no site (``grads_moved`` not None) tells the same, in a step where a forward ran, by whether
    a parameter's gradient changed and is not all 0.0.

    ``closed_form``: the norms whose gradient through them alone is a closed form, which
    bf16/fp16 tensors spoil (batch and group norms): their gradient rows are left out then.

    ``forwards`` (the step's forwards) and ``call_counts`` (each counter's calls in the last one)
    tell the slots that took several calls in one micro-step: several forwards in one, or a
    module called more than ``K`` times (its later calls share the last slot). Built-in
    norms add up there; a user's site statistic does not (``StepData.merged``).
    """
    values = np.asarray(values, dtype=np.float64).copy()
    keys = [k if isinstance(k, Key) else Key(*k) for k in keys]
    scale = next((values[i] for i, k in enumerate(keys) if k.quantity == SCALE), None)
    collected: dict[str, list] = {}
    scaled = {n for name, q in quantities.items() if q.reads_param_grads for n in q.names}
    for k, v in zip(keys, values):
        if k.quantity == SCALE:
            continue
        if scale is not None and k.quantity in scaled:
            if params_unscaled is None:  # (not known whether the gradients were unscaled: no rows, and a warning said so)
                continue
            if not params_unscaled:
                v = v / scale
        collected.setdefault(k.quantity, []).append((k, float(v)))
    n_taps = len(sites) * K
    collector, reached, traced, order, value, user_fwd, misfit = micro_steps(
        blocks["snapshots"], blocks["marks"], blocks["reached"], n_taps * (1 + len(grad_stats)), width)
    # the sites' ‖h‖ from the ‖h‖² the forwards of each micro-step added (fp32, as on the device)
    value[:, :n_taps] = np.sqrt(value[:, :n_taps].astype(np.float32))
    grad_sq = collector[:, :n_taps]
    # a gradient arrived: eagerly as seen; after a compiled backward where tapped (or non-zero:
    # a tap that reentrant checkpointing recomputed)
    arrived = (reached == REACHED) | ((reached == REACHED_IF_TAPPED) & ((order[:, :n_taps] > 0) | (grad_sq != 0)))
    # no backward: the forward tapped gradients and none came, or every forward ran under torch.no_grad;
    # a step with no forward at all reads the gradients as they are
    no_backward = backwards == 0 and (bool((order > 0).any()) or (bool((order != 0).any()) and grad_forwards == 0))
    if grads_moved is not None:  # (no site hooked: no order marks) no gradient changed, or every one is 0.0 (a
        # zero_grad(set_to_none=False) with no backward after it), or every forward ran under torch.no_grad
        zeroed = any(k.site == "" and v == 0.0 for k, v in collected.get("param_grad_norm", ()))
        no_backward = bool(forwards) and (not grads_moved or zeroed or grad_forwards == 0)
    if no_backward:
        gradients = {name for name, q in quantities.items() if q.needs_backward or name in grad_stats}
        wants = wants - gradients
        collected = {name: rows for name, rows in collected.items() if name not in gradients}
    base, index = len(sites) * K, {p.name: i for i, p in enumerate(sites)}
    names = [n.name for n in layout.norms]
    calls = misfit[base: base + len(names) * K].reshape(len(names), K)  # (norms, calls)
    worst = calls.max(axis=1)  # (NaN if a call's input held an inf or a NaN: then no mark below holds)
    unfit, low, untold, guessed = ({names[j] for j in np.flatnonzero(flag).tolist()} for flag in (
        (calls > MISFIT_LIMIT).any(axis=1), worst >= LOW_PRECISION, (UNTOLD <= worst) & (worst < LOW_PRECISION),
        (GUESSED <= worst) & (worst <= MISFIT_LIMIT)))
    # the gradient through a norm alone, as a closed form of rounded tensors (batch and group norms on bf16/fp16),
    # is not known: no rows (every other norm's is exact: capture/norm_alone.py); marks otherwise concern w/σ only
    grad_left_out = {name for name in low if name in closed_form}
    for n in layout.norms:
        if n.name in grad_left_out and n.site_in in index:
            i = index[n.site_in]
            grad_sq[:, i * K:(i + 1) * K] = 0
            arrived[:, i * K:(i + 1) * K] = False
            order[:, i * K:(i + 1) * K] = -np.abs(order[:, i * K:(i + 1) * K])
    if scale is not None:
        grad_sq = grad_sq / (scale * scale)
    merged = np.zeros(n_taps, dtype=bool)  # slots that took several calls in one micro-step
    if forwards is not None and forwards > len(collector):
        merged[:] = True
    for i, n in enumerate((call_counts or [])[:len(sites)]):
        if n > K:
            merged[i * K + K - 1] = True
    user_values, channel = {}, 0  # (M, taps), or (M, taps, size) of a quantity whose site_value_size > 1
    for name in value_stats:
        size = getattr(quantities.get(name), "site_value_size", 1)
        user_values[name] = user_fwd[:, :n_taps, channel] if size == 1 else user_fwd[:, :n_taps, channel:channel + size]
        channel += size
    user_grads = {name: collector[:, (k + 1) * n_taps:(k + 2) * n_taps] for k, name in enumerate(grad_stats)}
    data = StepData(layout=layout, sites=sites, K=K, grad_sq=grad_sq, arrived=arrived, order=order, value=value,
                    collected=collected, blocks=blocks, unfit=unfit, grad_left_out=grad_left_out, no_backward=no_backward,
                    low_precision=low,
                    user_values=user_values, user_grads=user_grads, untold=untold, guessed=guessed,
                    traced=traced[:, :n_taps], backwards=backwards, grad_forwards=grad_forwards,
                    key_cache={} if key_cache is None else key_cache, merged=merged)
    rows: list = []
    for name, quantity in quantities.items():
        if name in wants and not quantity.logged:
            rows += checked_rows(quantity, quantity.rows(data))
    for name, extra in collected.items():  # what the loop logged itself, wanted or not
        if name not in quantities or quantities[name].logged:
            rows += _per_micro(extra)
    return [k for k, _ in rows], np.array([v for _, v in rows], dtype=np.float64), data


def _per_micro(logged: list) -> list:
    """A scalar logged once per micro-step (``rec.log("loss", loss)`` after each backward):
    rows with micro_step 0, 1, ... and their mean as the step's row (-1)."""
    if len(logged) < 2 or any(k.micro_step != -1 for k, _ in logged):
        return logged
    rows = [(k._replace(micro_step=m), v) for m, (k, v) in enumerate(logged)]
    return rows + [(logged[0][0], float(np.mean([v for _, v in logged])))]
