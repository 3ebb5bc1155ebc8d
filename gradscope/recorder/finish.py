"""From a recorded step's host values to table rows: micro-steps, unscaling, quantities.

Runs once per recorded step on the numbers that just reached the host; no device work.
"""

from __future__ import annotations

import warnings

import numpy as np

from gradscope.recorder.capture import FWD, LOW_PRECISION
from gradscope.recorder.quantities import REGISTRY, StepData
from gradscope.recorder.wrappers import grad_versions

MISFIT = 1e-4  # a fitted norm whose residual exceeds this share of Var(y) is not of the form g·x̂ + b

SCALE = "__scale__"


def micro_steps(snapshots: np.ndarray, marks: np.ndarray, n_taps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Splits the captured snapshots into micro-steps: (grad², order, value), each (M, ·),
    and each slot's largest norm-fit misfit over the step.

    Each snapshot is one backward's ‖grad‖² per tap followed by the forward buffer (eager
    calls' order marks come in ``marks``, as they are kept on the host). A
    snapshot with no forward call since the one before (the inner backward of reentrant
    checkpointing) adds its gradients to that micro-step; a last snapshot with neither is
    dropped.
    """
    grads, fwd = snapshots[:, :n_taps], snapshots[:, n_taps:].reshape(len(snapshots), -1, FWD).copy()
    fwd[:, :, 0] += marks  # eager calls keep their order marks on the host, compiled ones on the device
    keep_g, keep_o, keep_v, misfit = [], [], [], fwd[:, :, 2].max(axis=0)
    for g, f in zip(grads, fwd):
        called = bool((f[:, 0] != 0).any())
        if not called:
            if keep_g:
                keep_g[-1] = keep_g[-1] + g
            continue
        keep_g.append(g.copy())
        keep_o.append(f[:, 0])
        keep_v.append(f[:, 1])
    if not keep_g:
        n = fwd.shape[1]
        return np.zeros((0, n_taps)), np.zeros((0, n)), np.zeros((0, n)), misfit
    return np.stack(keep_g), np.stack(keep_o), np.stack(keep_v), misfit


def step_rows(keys: list, values: np.ndarray, blocks: dict, *, layout, points, K: int, wants: set[str],
              params_unscaled: bool, backwards: int = 1) -> tuple[list, np.ndarray, StepData]:
    """The rows of one recorded step, in the quantities' registry order.

    Gradient norms are divided by the GradScaler scale (key ``__scale__``); parameter norms
    only if the user had not unscaled them already. ``backwards``: the backwards the capture
    saw inside the step; when the forward tapped gradients but none came, the quantities
    that read gradients have no rows (their values would be 0.0 or an earlier step's).
    """
    values = np.asarray(values, dtype=np.float64).copy()
    scale = next((values[i] for i, k in enumerate(keys) if k[4] == SCALE), None)
    device: dict[str, list] = {}
    for k, v in zip(keys, values):
        if k[4] == SCALE:
            continue
        if scale is not None and k[4] in ("param_grad_norm", "grad_rms_over_eps") and not params_unscaled:
            v = v / scale
        device.setdefault(k[4], []).append((k, float(v)))
    grad_sq, order, value, misfit = micro_steps(blocks["snapshots"], blocks["marks"], len(points) * K)
    no_backward = backwards == 0 and bool((order > 0).any())
    if no_backward:
        wants = {name for name in wants if not (name in REGISTRY and REGISTRY[name].needs_backward)}
        device = {name: rows for name, rows in device.items() if not (name in REGISTRY and REGISTRY[name].needs_backward)}
    base, index = len(points) * K, {p.name: i for i, p in enumerate(points)}
    unfit = {n.name for j, n in enumerate(layout.norms) if (misfit[base + j * K: base + (j + 1) * K] > MISFIT).any()}
    low = {n.name for j, n in enumerate(layout.norms) if (misfit[base + j * K: base + (j + 1) * K] >= LOW_PRECISION).any()}
    for n in layout.norms:  # the gradient through a norm that is not g·x̂ + b is not known: no rows
        if n.name in unfit and n.site_in in index:
            i = index[n.site_in]
            grad_sq[:, i * K:(i + 1) * K] = 0
            order[:, i * K:(i + 1) * K] = -np.abs(order[:, i * K:(i + 1) * K])
    if scale is not None:
        grad_sq = grad_sq / (scale * scale)
    data = StepData(layout, points, K, grad_sq, order, value, device, blocks, unfit, no_backward, low)
    rows: list = []
    for name, quantity in REGISTRY.items():
        if name in wants and not quantity.logged:
            rows += quantity.rows(data)
    for name, extra in device.items():  # what the loop logged itself, wanted or not
        if name not in REGISTRY or REGISTRY[name].logged:
            rows += _per_micro(extra)
    return [k for k, _ in rows], np.array([v for _, v in rows], dtype=np.float64), data


def _per_micro(logged: list) -> list:
    """A scalar logged once per micro-step (``rec.log("loss", loss)`` after each backward):
    rows with micro_step 0, 1, ... and their mean as the step's row (-1)."""
    if len(logged) < 2 or any(k[0] != -1 for k, _ in logged):
        return logged
    rows = [((m, *k[1:]), v) for m, (k, v) in enumerate(logged)]
    return rows + [(logged[0][0], float(np.mean([v for _, v in logged])))]


def check_calls(rec, step: int, data: StepData, calls: list[int]) -> bool:
    """Raises when no hook fired although backward ran; warns (once each) about sites that
    saw no call, norms of unknown form and modules called more often than ``max_calls``.
    Returns whether any site has been seen so far."""
    if data.no_backward and "no_backward" not in rec._warned:
        rec._warned.add("no_backward")
        warnings.warn(f"gradscope: step {step} was recorded but no backward ran inside it, so it has no gradient rows "
                      "(act_grad_norm, ln_gain, param_grad_norm, ...): call loss.backward() inside `with rec.step(step):` "
                      "(or before rec.end_step()). Later steps like this are not reported again.", stacklevel=4)
    seen = {p.name for p, c, _, _ in data.slot_sites() if c == 0}
    if not seen:
        if not rec._ever_seen and rec._grad_versions is not None and rec._grad_versions != grad_versions(rec.model):
            raise RuntimeError(
                "Recorder: backward ran in this step but none of the recorder's hooks fired. Most likely the model "
                "was compiled and called before the Recorder was made (torch.compile does not see hooks added after "
                "its first trace): make the Recorder before the first compiled call, or call torch._dynamo.reset(). "
                "Or another instance of the same model class was compiled and run before the Recorder was made, and "
                "Dynamo, which then did not guard on module hooks, reuses that graph: make the Recorder first (while a "
                "Recorder is open, gradscope turns torch._dynamo.config.skip_nnmodule_hook_guards off)."
            )
        return rec._ever_seen
    silent = [p.name for p in rec._capture.points if p.name not in seen and p.name not in rec._warned]
    if silent:
        rec._warned.update(silent)
        warnings.warn(f"gradscope: {len(silent)} site(s) saw no call in step {step} and have no rows: "
                      f"{silent[:8]}{' ...' if len(silent) > 8 else ''} (drop them with sites=...)", stacklevel=4)
    if "cosine" in rec._wants:
        written = {k.split(":", 1)[1]: w for k, w in data.blocks.items() if k.startswith("cosine_written:")}
        missing = [st.name for st in rec.layout.stacks if not (st.name in written and written[st.name].all())
                   and f"cosine:{st.name}" not in rec._warned]
        if missing:
            rec._warned.update(f"cosine:{m}" for m in missing)
            warnings.warn(f"gradscope: no cosine rows for stack(s) {missing} in step {step}: not every layer output "
                          "was seen with the stack's feature width (outputs that change width, as a convolutional "
                          "feature encoder's, or a layer that was not called)", stacklevel=4)
    if "cosine" in rec._wants and not rec.layout.stacks and "cosine" not in rec._warned:
        rec._warned.add("cosine")
        warnings.warn("gradscope: no cosine rows: the model has no layer stack (an nn.ModuleList of two or more "
                      "blocks of one class; x-transformers alternates attention and feed-forward blocks), "
                      "or sites= left out its outputs", stacklevel=4)
    low = sorted(data.low_precision - rec._warned)
    if low:
        rec._warned.update(low)
        warnings.warn(f"gradscope: {low[:4]} ran on bf16/fp16 tensors; the gradient through a norm that is not "
                      "nn.LayerNorm/nn.RMSNorm is then computed from a fit that is not exact (measured up to 3e-4 off "
                      "under bf16 autocast), so they have no ln_gain, ln_w_over_sigma or '.in' gradient rows", stacklevel=4)
    unfit = sorted(data.unfit - data.low_precision - rec._warned)
    if unfit:
        rec._warned.update(unfit)
        warnings.warn(f"gradscope: {unfit[:4]} do not map their normalised input to their output with one gain per "
                      "feature (adaptive norms?): the gradient through them alone is not known without re-running "
                      "them, so they have no ln_gain, ln_w_over_sigma or '.in' gradient rows", stacklevel=4)
    over = [p.name for p, n in zip(rec._capture.points, calls) if n > rec._capture.K and p.name not in rec._warned]
    if over:
        rec._warned.update(over)
        warnings.warn(f"gradscope: {over[:4]} called more than max_calls={rec._capture.K} times in one forward; "
                      "later calls are added into the last row (raise max_calls)", stacklevel=4)
    return True


def check_monotone(rec, step: int, last: int | None) -> int:
    """Warns (once per Recorder) when ``step`` is recorded again or out of order: the table
    would hold that step twice (``gradscope.load`` of a ``log_dir`` keeps the last write).
    Returns the highest step recorded so far."""
    if last is not None and step <= last and "repeat" not in rec._warned:
        rec._warned.add("repeat")
        warnings.warn(f"gradscope: step {step} recorded after step {last}: step indices should increase, or the table "
                      "holds a step twice (rec.frame() keeps both; gradscope.load(log_dir) keeps the last write of "
                      "each step). Pass the global step to rec.step(). Not reported again.", stacklevel=5)
    return step if last is None else max(step, last)
