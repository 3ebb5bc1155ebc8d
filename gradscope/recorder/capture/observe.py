"""What a recorded step's hooks do with one site value or one norm call: the statistics of
:class:`~gradscope.recorder.capture.capture.Capture`, as a mixin of it.

The permanent hooks (:mod:`gradscope.recorder.capture.site_hooks`) find their Capture and call
:meth:`SiteObserver._observe` with a site's value, or :meth:`SiteObserver._norm_output`
with a norm's input and output. Each asks the capture's writer (traced by Dynamo, or
eager) where the call goes, marks its order, writes the forward statistics and returns the
tapped value that carries the gradient statistics, or None to keep the module's own.
"""

from __future__ import annotations

import torch

from gradscope.recorder.numerics.norm_stats import LOW_PRECISION, fit_norm, norm_gain, w_over_sigma
from gradscope.recorder.capture.site_hooks import GRAD_EXPECTED, TAPPED
from gradscope.recorder.capture.taps import first_tensor, main_input, replace_first, statistic

# forward-buffer channels: order mark, value (a site's ‖h‖², added over the forwards of a micro-step;
# a norm's w/σ), misfit of a fitted norm; then user statistics
FWD = 3


class SiteObserver:
    """The per-call statistics of a :class:`~gradscope.recorder.capture.capture.Capture` (its
    attributes are the capture's: writers, buffers, wanted captures, site plan)."""

    def _observe(self, i: int, t: torch.Tensor, module_args: tuple, flags: int) -> torch.Tensor | None:
        """Statistics of one site value; returns the tapped value (or None to keep it).
        ``module_args``: (args, kwargs) of the module whose output ``t`` is; ``flags``: the
        site's :data:`TAPPED` and :data:`GRAD_EXPECTED` (from its hook's tag)."""
        if torch.compiler.is_compiling():  # (first: Dynamo then reads none of the attributes below)
            w = self._traced
        elif self._quick_now and self._quick[i] and torch._C._current_autograd_node() is None:
            return self._observe_eagerly(i, t, flags)
        else:
            w = self._eager_writer
        c, recompute = w.call(i)
        slot = i * self.K + c
        grad = self.want_grad and t.requires_grad and torch.is_grad_enabled()
        if not recompute:
            self.seq += 1
            w.mark(slot, self.seq if grad and flags & GRAD_EXPECTED else -self.seq)
            if self.want_value:
                w.value(slot, t)
            if self.stats_now:
                for k, f in enumerate(self.value_stats):
                    w.put(slot, FWD + k, statistic(f, t.detach(), f"site {self.points[i].name!r}"))
            if self.want_cosine and c == 0:
                self.cosine.sample(self.points[i].name, t)
        if not (grad and flags & TAPPED):
            return None
        return w.tap(i, t, slot, recompute, module_args)

    def _observe_eagerly(self, i: int, t: torch.Tensor, flags: int) -> torch.Tensor | None:
        """:meth:`_observe` of a :attr:`_quick` site, eagerly, outside a recompute, in a step
        without user statistics or cosine samples: the :class:`EagerWriter`'s work in one frame."""
        calls, K = self.calls, self.K
        c = calls.get(i, 0)
        calls[i] = c + 1
        slot = i * K + (c if c < K else K - 1)
        grad = self.want_grad and t.requires_grad and torch.is_grad_enabled()
        self.seq = seq = self.seq + 1
        self.marks[slot] = seq if grad and flags & GRAD_EXPECTED else -seq
        if self.want_value:
            self.values.add(slot, t)
        if not (grad and flags & TAPPED):
            return None
        out = t[...]  # the alias whose kept gradient is the site's (EagerWriter.tap)
        self.eager.retain(out, slot, False)
        self.values.passed_on(t, out)  # (value_sq serves only models without the promise)
        return out


    def _norm_output(self, module, args, kwargs, output, j: int, kind: str | None):
        counter, point = len(self.points) + j, self._norm_in[j]
        found, y = main_input(args, kwargs), first_tensor(output)
        if found is None or y is None or found[1].is_nested or y.is_nested or found[1].shape != y.shape:
            return None  # (a nested tensor, nn.TransformerEncoder's fast path: no per-token rows to read a norm from)
        x, w = found[1], self.writer()
        c, recompute = w.call(counter)
        grad = (kind not in (None, "ln") and point is not None and self.want_grad and y.requires_grad
                and torch.is_grad_enabled())
        wsig = self.want_wsig and not recompute
        # a closed form read from bf16/fp16 tensors is not exact (up to 5e-3 off): flagged, no rows, no fit
        exact = x.dtype in (torch.float32, torch.float64) and y.dtype in (torch.float32, torch.float64)
        fit = fit_norm(module, x, y) if kind == "fit" and (grad or wsig) and exact else None  # one fit serves both
        slot = self.n_taps + j * self.K + c
        if fit is not None and not recompute:
            w.put(slot, 2, fit.misfit)
        elif not exact and kind not in (None, "ln") and (grad or wsig) and not recompute:
            w.put(slot, 2, x.new_full((), LOW_PRECISION, dtype=torch.float32))
        if wsig:
            value = w_over_sigma(module, x, y, fit)
            if value is not None:
                w.mark(slot, 1.0)
                w.put(slot, 1, value)
        gain = norm_gain(module, kind, x, fit) if grad else None
        if gain is None:
            return None
        gain_w, is_ln, eps, dims = gain
        tapped = w.norm_tap(y, x, point * self.K + c, kind, gain_w, is_ln, eps, dims)
        return replace_first(output, tapped)

