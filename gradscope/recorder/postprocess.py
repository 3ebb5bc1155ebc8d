"""Host-side rows of one recorded step: unscaling, accumulation, ln_gain, nonfinite.

Runs once per recorded step on the numbers that just reached the host; no device work.
"""

from __future__ import annotations

import math

import numpy as np

from gradscope.recorder.layout import Layout



def finish_rows(keys: list, values: np.ndarray, layout: Layout, wants: set[str], *, micro_steps: int,
                params_unscaled: bool) -> tuple[list, np.ndarray]:
    """Turns the raw keys/values of a step into table rows.

    - Divides gradient norms by the GradScaler scale (row ``__scale__``), parameter norms
      only if the user had not unscaled them already.
    - Per-micro-step ``act_grad_norm`` / ``act_norm`` rows keep their micro index; the
      accumulated value (micro_step -1) is sqrt(Σ_m v_m²), the norm over the whole
      accumulated batch. With one micro-step only the -1 rows are kept.
    - ``ln_gain`` = ‖J_LNᵀ g‖ / ‖g‖, g the gradient at the norm output and J_LN the norm's
      Jacobian: the factor by which backward through that norm alone scales the gradient
      (Takase §3), per micro-step and accumulated.
    - ``nonfinite`` / ``nonfinite_grad``: sites whose forward value / gradient held a NaN or
      Inf, in the order they appeared; value 0 is the first.
    - Other per-micro-step statistics (``ln_w_over_sigma``) are averaged over micro-steps
      for the -1 row.
    - ``dlcl_weight`` of a DLCL stack keeps the lower triangle only.
    """
    values = np.asarray(values, dtype=np.float64).copy()
    scale = next((values[i] for i, k in enumerate(keys) if k[4] == "__scale__"), None)
    if scale is not None:
        for i, k in enumerate(keys):
            if k[4] in ("act_grad_norm", "__ln_in__", "__ln_out__") or (k[4] == "param_grad_norm" and not params_unscaled):
                values[i] /= scale
    rows: list[tuple] = []
    out: list[float] = []
    per_site: dict[tuple, list[float]] = {}  # (quantity, site) -> per-micro values
    per_micro_mean: dict[tuple, list[float]] = {}  # forward statistics averaged over micro-steps
    gains: dict[tuple, dict[int, float]] = {}  # ("__ln_in__" | "__ln_out__", norm) -> micro -> value
    position: dict[str, tuple] = {}
    n_fwd = n_bwd = 0
    for k, v in zip(keys, values):
        micro, stack, layer, site, quantity, layer_j = k
        if quantity == "__scale__":
            continue
        if quantity in ("__ln_in__", "__ln_out__"):
            gains.setdefault((quantity, site), {})[micro] = v
            continue
        if quantity in ("act_norm", "act_grad_norm"):
            if "nonfinite" in wants and not math.isfinite(v):
                name = "nonfinite" if quantity == "act_norm" else "nonfinite_grad"
                order = n_fwd if quantity == "act_norm" else n_bwd
                rows.append((micro if micro_steps > 1 else -1, stack, layer, site, name, None))
                out.append(float(order))
                n_fwd, n_bwd = (n_fwd + 1, n_bwd) if quantity == "act_norm" else (n_fwd, n_bwd + 1)
            per_site.setdefault((quantity, site), []).append(v)
            position[site] = (stack, layer)
            if micro_steps > 1 and quantity in wants:
                rows.append(k)
                out.append(v)
            continue
        if quantity == "dlcl_weight" and site.endswith("combine") and layer_j > layer:
            continue
        if micro >= 0:  # a per-micro-step forward statistic (ln_w_over_sigma)
            per_micro_mean.setdefault((quantity, site), []).append(v)
            position[site] = (stack, layer)
            if micro_steps == 1:
                continue
        rows.append(k)
        out.append(v)
    for (quantity, site), vs in per_micro_mean.items():
        rows.append((-1, *position[site], site, quantity, None))
        out.append(sum(vs) / len(vs))
    accumulated = {key: _rss(vs) for key, vs in per_site.items()}
    for (quantity, site), value in accumulated.items():
        if quantity in wants:
            rows.append((-1, *position[site], site, quantity, None))
            out.append(value)
    if "ln_gain" in wants:
        for norm in layout.norms:
            g_in, g_out = gains.get(("__ln_in__", norm.name), {}), gains.get(("__ln_out__", norm.name), {})
            micros = sorted(g_in.keys() & g_out.keys())  # micro-steps whose backward reached this norm
            if not micros:
                continue
            if micro_steps > 1:
                for m in micros:
                    rows.append((m, norm.stack, norm.layer, norm.name, "ln_gain", None))
                    out.append(_ratio(g_in[m], g_out[m]))
            rows.append((-1, norm.stack, norm.layer, norm.name, "ln_gain", None))
            out.append(_ratio(_rss([g_in[m] for m in micros]), _rss([g_out[m] for m in micros])))
    return rows, np.asarray(out, dtype=np.float64)


def _rss(values: list[float]) -> float:
    """sqrt(Σ v²): the norm over the whole accumulated batch from per-micro-step norms."""
    return math.sqrt(sum(v * v for v in values))


def _ratio(a: float, b: float) -> float:
    return a / b if b != 0 else (math.nan if a == 0 else math.inf)
