"""The identity autograd Functions that carry a site's gradient norm out of backward, and
how a hook finds a module's main input and output tensors."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gradscope.recorder.numerics.norm_stats import isolated_grad
from gradscope.recorder.numerics.squared_norms import dense_squared_norm


def in_backward() -> bool:
    """Whether a forward runs inside backward (activation checkpointing recomputing)."""
    return not torch.compiler.is_compiling() and torch._C._current_autograd_node() is not None


def collector_grad(sq: torch.Tensor, grad: torch.Tensor, slot: int, size: int, stats: tuple) -> torch.Tensor:
    """The collector's gradient from one tap: ‖grad‖² at ``slot`` and, with user statistics
    (``stats``: the wanted quantities' ``site_grad``), statistic k at ``slot + k·taps``."""
    if not stats:
        return F.pad(sq.reshape(1), (slot, size - slot - 1))
    taps = size // (1 + len(stats))
    values = torch.stack([sq.reshape(()), *(statistic(f, grad) for f in stats)])
    at = torch.arange(len(stats) + 1, device=grad.device) * taps + slot
    return values.new_zeros(size).index_copy(0, at, values)


class Tap(torch.autograd.Function):
    """Identity in forward; backward passes the gradient on unchanged and adds ‖grad‖²
    (fp32) at ``slot`` of the collector's gradient (and the user statistics ``stats`` further
    on: :func:`collector_grad`). Run eagerly (``eager`` given: an
    :class:`~gradscope.recorder.capture.eager.EagerGrads`), it hands them to that instead, which
    saves the collector's padding and summing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, collector: torch.Tensor, slot: int, eager, stats: tuple = ()) -> torch.Tensor:
        # (forward takes ctx itself: a separate setup_context makes every eager apply bind its
        # arguments through inspect.signature, which costs more than the rest of the tap)
        ctx.slot, ctx.size, ctx.eager, ctx.stats = slot, collector.shape[0], eager, stats
        ctx.epoch = None if eager is None else eager.epoch
        return x.detach()  # an alias, not a view: in-place ops after the site stay legal

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, _taken(ctx, grad), None, None, None


class NormTap(torch.autograd.Function):
    """Identity on a norm's output; backward adds ‖Jᵀgrad‖² (the gradient through the norm
    alone, at its input; :func:`~gradscope.recorder.numerics.norm_stats.isolated_grad_sq`) at ``slot``."""

    @staticmethod
    def forward(ctx, y, x, collector, slot, kind, w, is_ln, eps, dims, eager, stats=()):
        ctx.slot, ctx.kind, ctx.eps, ctx.dims, ctx.eager, ctx.size = slot, kind, eps, dims, eager, collector.shape[0]
        ctx.stats, ctx.epoch = stats, None if eager is None else eager.epoch
        ctx.save_for_backward(x, w, is_ln)
        return y.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        none = (None,) * 10
        if ctx.eager is not None and not ctx.eager.live(ctx.epoch):
            return grad, *none
        x, w, is_ln = ctx.saved_tensors
        through = isolated_grad(ctx.kind, x, grad, w, is_ln, ctx.eps, ctx.dims)
        if ctx.eager is not None:
            ctx.eager.add(ctx.slot, through)
            return grad, *none
        return grad, None, collector_grad(dense_squared_norm(through), through, ctx.slot, ctx.size, ctx.stats), *none[:8]


class InputTap(Tap):
    """:class:`Tap` on the input of a norm run again alone (:class:`JoinTap`): backward takes
    the gradient's statistics, as a Tap does, and gives the input nothing, since the input's
    real gradient flows through the norm's own call."""

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, _taken(ctx, grad), None, None, None


def _taken(ctx, grad: torch.Tensor) -> torch.Tensor | None:
    """What a tap does with the gradient it sees: eagerly (``ctx.eager``) it hands it over,
    no padding or summing, and the collector gets nothing; traced, it returns the collector's
    gradient holding ‖grad‖² (and the user statistics) at its slot."""
    if ctx.eager is not None:
        if ctx.eager.live(ctx.epoch):
            ctx.eager.add(ctx.slot, grad)
        return None
    return collector_grad(dense_squared_norm(grad), grad, ctx.slot, ctx.size, ctx.stats)


class JoinTap(torch.autograd.Function):
    """Identity on a norm's output ``y``; backward hands the gradient at ``y`` on unchanged
    and also to ``alone``, the same norm run again on an :class:`InputTap` of its input with
    its parameters detached, so that the gradient through the norm alone reaches that tap
    (exact for any norm, whatever its form) while every real gradient stays as autograd
    makes it."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, alone: torch.Tensor) -> torch.Tensor:
        return y.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad


def first_tensor(value) -> torch.Tensor | None:
    """A module output's main tensor: the value itself, or the first item of a tuple/list."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def replace_first(value, new: torch.Tensor):
    if isinstance(value, torch.Tensor):
        return new
    return type(value)((new, *value[1:])) if isinstance(value, tuple) else [new, *value[1:]]


def main_input(args: tuple, kwargs: dict) -> tuple[str | int, torch.Tensor] | None:
    """(position or keyword, tensor) of a module's main input: the first positional tensor,
    else the first floating-point tensor passed by keyword (``hidden_states``, ``x``...)."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return (i, a) if a.is_floating_point() else None
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return k, v
    return None


def statistic(f, t: torch.Tensor, where: str | Callable[[], str] = "a site", size: int = 1) -> torch.Tensor:
    """``f(t)`` (a quantity's ``site_value`` or ``site_grad``) as a 0-d fp32 tensor (``size``
    > 1: a 1-d one of ``size`` numbers, a ``site_value`` whose quantity sets ``site_value_size``).

    ``where`` names the site in an error: a string, or a function that makes it (called only
    then, so a hook in backward builds no string per site).

    Raises:
        TypeError: naming the quantity, the method and ``where``, when it is not a
            tensor of ``size`` elements.
    """
    v = f(t)
    if not isinstance(v, torch.Tensor) or v.numel() != size:
        q = getattr(f, "__self__", None)
        got = f"a tensor of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else f"a {type(v).__name__}"
        where = where if isinstance(where, str) else where()
        want = "a 0-d tensor (one number" if size == 1 else f"a tensor of {size} numbers (site_value_size"
        raise TypeError(f"{type(q).__name__}.{getattr(f, '__name__', 'statistic')} at {where}: must return "
                        f"{want} per site and call, from tensor ops), got {got}")
    return v.float().reshape(() if size == 1 else (size,))
