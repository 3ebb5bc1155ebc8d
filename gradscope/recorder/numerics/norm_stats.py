"""w/σ of a normalisation layer from the input and output of one call (Xu 2020 Table 2).

``ln_w_over_sigma`` = mean over tokens t and features f of g_f / σ_t: σ_t is what the norm
divides token t by, g_f the per-feature gain it then applies. Below 1, the norm shrinks the
residual stream it reads.

- ``nn.LayerNorm``: σ_t = sqrt(Var(x_t) + eps) over the normalised dimensions, g = weight.
- ``nn.RMSNorm``: σ_t = sqrt(mean(x_t²) + eps), g = weight.
- gradscope's ``ScaleNorm`` (g·x/max(‖x‖, eps), Nguyen & Salazar Eq. 7): in the same units
  (x/σ of unit RMS) σ_t = ‖x_t‖/√d and the gain is g/√d, so g_f/σ_t = g/max(‖x_t‖, eps).
- Any other token-wise norm (nanoGPT's LayerNorm, HF ``LlamaRMSNorm``, ``T5LayerNorm``,
  Gemma's x·(1+w), x-transformers' norms): the recorder does not know how the module
  parametrises its gain, so it reads it from what the call did. Both candidate
  normalisations x̂ = (x-μ)/σ and x/σ (with the module's ``eps``, ``variance_epsilon`` or
  ``epsilon``, else 1e-6) are fitted per feature as y ≈ g·x̂ + b by least squares over the
  call's tokens; the better fit names the normalisation and gives g. Exact (to rounding)
  for any norm of that form, whatever its parametrisation.
- Batch, group and instance norms divide by statistics over the batch, not per token:
  no value.

The closed forms of ``nn.RMSNorm``, ScaleNorm and batch and group norms give the gradient
through a norm alone (``ln_gain``'s numerator and the ``<norm>.in`` site) from the norm's
input and the gradient at its output, computed in the backward of the tap on the norm's
output (:func:`isolated_grad_sq`; RMSNorm and ScaleNorm only where Dynamo traces the call:
eagerly their autograd edges are read, which costs less); every other norm is run again
alone for it (:mod:`gradscope.recorder.capture.norm_alone`), so a fit serves w/σ only. A tap on the
norm's input would group the gradient's summands differently from autograd when the norm
uses its input twice (RMSNorm, ScaleNorm) and so change training in the last bit.

Nothing here runs the norm again; every function reads the call's own tensors.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from gradscope.models.norms import ScaleNorm
from gradscope.recorder.numerics.squared_norms import dense_squared_norm

_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")
FIT_TOKENS = 256  # tokens a foreign norm's form, gain and eps are fitted on
_EPS_ROUNDS = 10  # rounds of reading an unnamed eps from a call (each removes most of the last one's error)
EPS_GUESS = 5e-6  # an unnamed eps that the call cannot tell: within 5e-6 of any eps in [0, 1e-5]
GUESSED = 1e-10  # misfit mark: eps guessed (rows kept, a warning says so); an exact fit's misfit is ~1e-14
_EPS_SPREAD = 0.1  # below this spread of the tokens' variances (std / mean), eps is not read from the call
_EPS_MIN_VARIANCE = 0.5  # ...and below this mean variance, the guess is not good to 1e-5 either: no rows
UNTOLD = 1e3  # misfit mark: the call cannot tell the norm's form or its unnamed eps (its gradient rows are left out)
_TIED = 1e-10  # both forms fit a call this well: its input is already centred, LayerNorm's form and RMSNorm's agree
LOW_PRECISION = 1e6  # misfit mark: a closed-form norm called on bf16/fp16 tensors (its gradient rows are left out)
_BATCH_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LocalResponseNorm)


def norm_eps(module: nn.Module, default: float = 1e-6) -> float:
    """The epsilon a norm adds to its variance (the first of eps, variance_epsilon, epsilon;
    a class that wraps one bare norm, that norm's)."""
    for m in (module, *module.children()):
        for attr in _EPS_ATTRS:
            value = getattr(m, attr, None)
            if isinstance(value, (int, float)):
                return float(value)
    return default


class Fit(NamedTuple):
    """A foreign norm's form and gain, read from one call (see the module docstring)."""

    gain: torch.Tensor  # (d,) fp32 per-feature gain
    is_ln: torch.Tensor  # 0-d bool: LayerNorm's form fits better than RMSNorm's
    inv_sigma: torch.Tensor  # 0-d: mean over tokens of 1/σ_t in the better form
    misfit: torch.Tensor  # 0-d fp32: the fit's mean squared residual over Var(y); UNTOLD: eps not known
    eps: torch.Tensor | float  # the module's eps, or (none named) the one read from the call, of the better form


def has_eps(module: nn.Module) -> bool:
    """Whether the norm names its epsilon (``eps``, ``variance_epsilon`` or ``epsilon``)."""
    return any(isinstance(getattr(m, a, None), (int, float)) for m in (module, *module.children()) for a in _EPS_ATTRS)


def fit_norm(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Fit | None:
    """Fits y ≈ g·x̂ + b per feature, x̂ LayerNorm's or RMSNorm's normalisation of the last
    dimension, by least squares over the call's tokens; None for a single token, where a
    per-feature gain cannot be told from a bias. ``misfit`` is far from 0 when the output
    is not of that form (an adaptive norm whose gain depends on the token): the gradient
    through such a norm cannot be had without re-running it.

    The eps is the module's when it names one. Otherwise (nanoGPT's ``F.layer_norm(...,
    1e-5)``, a literal) it is read from the call: with a first guess the per-token scale
    s_t of y − b against g·u_t is fitted, and 1/s_t² = α(v_t + eps) is linear in the
    token's variance v_t, so eps = intercept / slope. Exact to rounding for any eps a
    token's variance does not swamp; where it does, eps changes nothing measurable. When the
    tokens' variances are nearly equal (spread under 10 %: a norm after a norm) that slope is
    rounding noise, so eps is taken as :data:`EPS_GUESS` and ``misfit`` is at least
    :data:`GUESSED` (a warning says so: within 1e-5 relative of exact for an eps up to
    1e-5 and a variance of at least 0.5; a literal eps of 1e-2 was measured 6e-5 off); when
    the tokens' variance is below 0.5 as well, the call cannot tell eps and ``misfit`` is
    :data:`UNTOLD` (no rows, and a warning). So it is when
    the input is already centred (a norm after a norm) and the class does not say RMSNorm:
    both forms then fit, and their gradients differ."""
    d = x.shape[-1]
    x2, y2 = x.detach().reshape(-1, d), y.detach().reshape(-1, d)
    n = x2.shape[0]
    if n < 2:
        return None
    if n > FIT_TOKENS:  # the form is exact on any tokens: a spread-out sample fits it at a fixed cost
        rows = torch.linspace(0, n - 1, FIT_TOKENS, device=x2.device).round().long()
        x2, y2 = x2[rows], y2[rows]
    xs, ys = x2.double(), y2.double()
    named = has_eps(module)
    eps0 = norm_eps(module)
    ln = _fit_form(xs - xs.mean(dim=-1, keepdim=True), ys, eps0, named)
    rms = _fit_form(xs, ys, eps0, named)
    var = ys.var().clamp_min(1e-30)
    is_ln = ln[2] <= rms[2]  # the better fit names the form, with no host sync
    misfit = torch.minimum(ln[2], rms[2]) / var
    # On a centred input (after another norm) both forms fit, but their gradients differ by r·mean(w⊙g):
    # the form is then the one the class names (…RMSNorm), or not known.
    tied = torch.maximum(ln[2], rms[2]) / var < _TIED
    if "rms" in type(module).__name__.lower():
        is_ln, untold = is_ln & ~tied, None
    else:
        untold = tied
    if not named:
        flat = torch.where(is_ln, ln[5], rms[5])
        misfit = torch.where(flat, misfit.clamp_min(GUESSED), misfit)
        eps_untold = torch.where(is_ln, ln[4], rms[4])
        untold = eps_untold if untold is None else untold | eps_untold
    if untold is not None:
        misfit = torch.where(untold, torch.full_like(misfit, UNTOLD), misfit)
    eps = eps0 if named else torch.where(is_ln, ln[3], rms[3])
    xf = x.detach().reshape(-1, d).float()  # 1/σ_t over every token of the call
    v = torch.where(is_ln, xf.var(dim=-1, unbiased=False), xf.square().mean(dim=-1))
    return Fit(torch.where(is_ln, ln[0], rms[0]).float(), is_ln, torch.rsqrt(v + eps).mean(), misfit.float(), eps)


def _fit_form(u: torch.Tensor, y: torch.Tensor, eps: float, named: bool):
    """(gain, bias, mean squared residual, eps, eps unknown, eps guessed) of y ≈ g·u/σ + b,
    σ_t = sqrt(mean u_t² + eps)."""
    v = u.square().mean(dim=-1, keepdim=True)
    g, b, res = _fit_gain(u * torch.rsqrt(v + eps), y)
    if named:
        return g, b, res, eps, None, None
    eps_hat = torch.as_tensor(eps, dtype=u.dtype, device=u.device)
    vt = v.squeeze(-1)
    vc = vt - vt.mean()
    for _ in range(_EPS_ROUNDS):  # each round: per-token scales with this gain, then eps from them, then the gain again
        gu = g * u  # per token, y − b = s_t·g·u_t with s_t = 1/σ_t (up to the gain's common scale)
        s = (gu * (y - b)).sum(dim=-1) / gu.square().sum(dim=-1).clamp_min(1e-300)
        inv_s2 = s.square().reciprocal()  # = α·(v_t + eps)
        alpha = (vc * (inv_s2 - inv_s2.mean())).sum() / vc.square().sum().clamp_min(1e-300)
        new = ((inv_s2.mean() - alpha * vt.mean()) / alpha).clamp_min(0.0)
        eps_hat = torch.where(torch.isfinite(new), new, eps_hat)
        r = torch.rsqrt(v + eps_hat)
        g, b, res = _fit_gain(u * r, y)
    flat = vc.square().mean().sqrt() < _EPS_SPREAD * vt.mean()  # the slope is noise: eps is not in the call
    eps_hat = torch.where(flat, torch.full_like(eps_hat, EPS_GUESS), eps_hat)
    g, b, res = _fit_gain(u * torch.rsqrt(v + eps_hat), y)
    return g, b, res, eps_hat, flat & (vt.mean() < _EPS_MIN_VARIANCE), flat


def w_over_sigma(module: nn.Module, x: torch.Tensor, y: torch.Tensor, fit: Fit | None = None) -> torch.Tensor | None:
    """mean_{t,f} g_f / σ_t for one call of ``module`` with input ``x`` and output ``y``
    (0-d float32 tensor), or None for norms with no per-token σ. ``fit``: this call's
    :func:`fit_norm`, when the caller has it already (foreign norms)."""
    if isinstance(module, _BATCH_NORMS):
        return None
    if isinstance(module, nn.LayerNorm):
        rstd = _saved_rstd(y)
        if rstd is not None:  # eager: the 1/σ LayerNorm saved for its backward, at no cost
            return _gain(module.weight) * _as_fp32(rstd).mean()
        dims = tuple(range(-len(module.normalized_shape), 0))
        sigma = torch.sqrt(x.detach().float().var(dim=dims, unbiased=False) + module.eps)
        return _gain(module.weight) * sigma.reciprocal().mean()
    x = x.detach()
    if isinstance(module, nn.RMSNorm):
        dims = tuple(range(-len(module.normalized_shape), 0))
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        sigma = torch.sqrt(x.float().pow(2).mean(dim=dims) + eps)
        return _gain(module.weight) * sigma.reciprocal().mean()
    if isinstance(module, ScaleNorm):
        norm = torch.linalg.vector_norm(x.float(), dim=-1).clamp_min(module.eps)
        return (module.g.detach().float() / norm).mean()
    fit = fit if fit is not None else fit_norm(module, x, y)
    return None if fit is None else (fit.gain.mean() * fit.inv_sigma).float()


def _saved_rstd(y: torch.Tensor) -> torch.Tensor | None:
    """1/σ per token as PyTorch's fused LayerNorm saved it for backward, when it can be read
    without side effects: eagerly (not while compiling), from an fp32/fp64 result, and not
    while a saved-tensor hook is active (checkpointing, offloading), where reading it could
    unpack or recompute it."""
    if torch.compiler.is_compiling():
        return None
    node = y.grad_fn
    if type(node).__name__ != "NativeLayerNormBackward0":
        return None
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None or top(True) is not None:
        return None
    rstd = node._saved_result2
    return rstd if rstd.dtype in (torch.float32, torch.float64) else None


def _gain(weight: torch.Tensor | None) -> torch.Tensor | float:
    return 1.0 if weight is None else _as_fp32(weight.detach()).mean()


def _as_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t.float()``, without the call when ``t`` is float32 already (``float()`` then returns
    ``t`` itself: the same values; an eager norm call saves the dispatch, 32 a step at d=16)."""
    return t if t.dtype is torch.float32 else t.float()


def _fit_gain(xhat: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-feature least squares y ≈ g·x̂ + b over tokens: (g, b, mean squared residual)."""
    xm, ym = xhat.mean(dim=0), y.mean(dim=0)
    xc, yc = xhat - xm, y - ym
    g = (xc * yc).sum(dim=0) / (xc * xc).sum(dim=0).clamp_min(math.ulp(1.0))
    residual = (yc - g * xc).pow(2).mean()
    return g, ym - g * xm, residual


# -- the gradient through a norm alone, from its input and the gradient at its output -----
NORM_KINDS: tuple[str | None, ...] = (None, "ln", "rms", "scale", "bn", "gn", "fit")
"""Every value :func:`norm_kind` gives (a hook carries its norm's kind as the index here)."""


def norm_kind(module: nn.Module) -> str | None:
    """How :func:`isolated_grad_sq` differentiates ``module``: ``"ln"``, ``"rms"``,
    ``"scale"``, ``"bn"``, ``"gn"``, ``"fit"`` (a foreign norm, its form and gain fitted per
    call) or None (one of :data:`NORM_KINDS`)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "bn"
    if isinstance(module, nn.GroupNorm):
        return "gn"
    if isinstance(module, _BATCH_NORMS):
        return None
    if isinstance(module, nn.LayerNorm):
        return "ln"
    if isinstance(module, nn.RMSNorm):
        return "rms"
    if isinstance(module, ScaleNorm):
        return "scale"
    return "fit"


def norm_gain(module: nn.Module, kind: str, x: torch.Tensor, fit: Fit | None = None):
    """(per-feature gain, 0-d bool "LayerNorm-like" or None, eps, normalised dims) of one
    call, as :func:`isolated_grad_sq` takes them; a fitted norm (``kind="fit"``) needs
    this call's ``fit`` and gives None without one."""
    if kind in ("ln", "rms"):
        dims = len(module.normalized_shape)
        w = module.weight.detach().float().reshape(-1) if module.weight is not None else None
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        return w, None, eps, dims
    if kind == "scale":
        return module.g.detach().float(), None, module.eps, 1
    if kind == "bn":
        return _bn_gain(module, x)
    if kind == "gn":
        w = module.weight.detach().float() if module.weight is not None else torch.ones(module.num_channels, device=x.device)
        return w, None, module.eps, module.num_groups
    return None if fit is None else (fit.gain, fit.is_ln, fit.eps, 1)


def _bn_gain(module: nn.Module, x: torch.Tensor):
    """A batch norm's gain per channel, and whether it normalises with the batch's own
    statistics (training, or no running statistics) or with its running ones (eval)."""
    C = module.num_features
    w = module.weight.detach().float() if module.weight is not None else torch.ones(C, device=x.device)
    batch_stats = module.training or not module.track_running_stats
    if not batch_stats:
        w = w * torch.rsqrt(module.running_var.detach().float() + module.eps)
    return w, None, module.eps, (1 if x.shape[1] == C else -1, batch_stats)


def isolated_grad_sq(kind: str, x: torch.Tensor, g: torch.Tensor, w, is_ln, eps: float, dims: int) -> torch.Tensor:
    """‖Jᵀg‖² of :func:`isolated_grad`, reduced by :func:`~gradscope.recorder.numerics.squared_norms.dense_squared_norm`."""
    return dense_squared_norm(isolated_grad(kind, x, g, w, is_ln, eps, dims))


def isolated_grad(kind: str, x: torch.Tensor, g: torch.Tensor, w, is_ln, eps: float, dims: int) -> torch.Tensor:
    """Jᵀg, J the norm's Jacobian at x: the gradient that flows back through the norm alone,
    as a (rows, normalised features) fp32 matrix (its elements are those of the gradient at
    the norm's input, in another shape). Closed forms (x̂ the normalised input, ĝ = w⊙g, r = 1/σ):
    LayerNorm r(ĝ − mean ĝ − x̂·mean(ĝx̂)); RMSNorm r(ĝ − x̂·mean(ĝx̂)); ScaleNorm
    (s/‖x‖)(g − x̂(x̂·g)); a batch norm in training LayerNorm's form over the batch per
    channel, in eval w·g/sqrt(running var + eps); a group norm LayerNorm's form per sample
    and group. Computed in fp32 from the call's own tensors."""
    if kind == "gn":  # per sample and group over (channels of the group, positions): LayerNorm's form
        N, C, G = x.shape[0], x.shape[1], dims
        spatial = x[0, 0].numel()
        w = w.reshape(1, C, 1).expand(N, C, spatial).reshape(N * G, -1)
        x, g, dims, kind = x.detach().reshape(N * G, -1), g.reshape(N * G, -1), 1, "ln"
    if kind == "bn":
        (channel, batch_stats), C = dims, x.shape[dims[0]]
        x2 = x.detach().movedim(channel, 0).reshape(C, -1).float()  # (C, everything else)
        g2 = g.movedim(channel, 0).reshape(C, -1).float()
        if not batch_stats:
            return w[:, None] * g2
        x, g, w, dims = x2, g2, w[:, None], 1  # LayerNorm's form: one row per channel, normalised over the batch
        kind = "ln"
    D = math.prod(x.shape[-dims:])
    x2, g2 = x.detach().reshape(-1, D).float(), g.reshape(-1, D).float()
    if kind == "scale":
        n = torch.linalg.vector_norm(x2, dim=-1, keepdim=True)
        xh = x2 / n.clamp_min(eps)
        jt = torch.where(n > eps, (w / n.clamp_min(eps)) * (g2 - xh * (xh * g2).sum(-1, keepdim=True)), (w / eps) * g2)
        return jt
    gh = g2 if w is None else g2 * w

    def ln() -> torch.Tensor:
        r = torch.rsqrt(x2.var(dim=-1, unbiased=False, keepdim=True) + eps)
        xh = (x2 - x2.mean(dim=-1, keepdim=True)) * r
        return r * (gh - gh.mean(-1, keepdim=True) - xh * (gh * xh).mean(-1, keepdim=True))

    def rms() -> torch.Tensor:
        r = torch.rsqrt(x2.square().mean(dim=-1, keepdim=True) + eps)
        xh = x2 * r
        return r * (gh - xh * (gh * xh).mean(-1, keepdim=True))

    if kind == "ln":
        return ln()
    if kind == "rms":
        return rms()
    return torch.where(is_ln, ln(), rms())
