"""A normalisation layer run again alone, for the gradient through it alone at its input.

``act_grad_norm`` at a norm's input (``<norm>.in``) and ``ln_gain`` need ∂loss/∂x through
the norm alone, not the input's whole gradient, which adds the residual branch's. For
``nn.LayerNorm`` a tap on the input gives it; for ``nn.RMSNorm`` and ScaleNorm traced by Dynamo,
a closed form (:func:`~gradscope.recorder.numerics.norm_stats.isolated_grad`). Any other norm
(nanoGPT's ``LayerNorm`` over ``F.layer_norm``, HF's ``LlamaRMSNorm``, Gemma's x·(1+w), one
written in a notebook), RMSNorm or ScaleNorm called on bf16/fp16 tensors, and, eagerly, every
RMSNorm and ScaleNorm (the edges below cost less than the closed form), is run again on the call's
own input with its parameters detached (:class:`NormAlone`), and the gradient at its output
is handed to that copy as well (:class:`~gradscope.recorder.capture.taps.JoinTap`): autograd
itself then computes the gradient through the norm alone, exactly, whatever the norm's form,
gain or eps. That is how it is read when traced by Dynamo; eagerly the gradient is read on
the autograd edges from the norm's own nodes into its input instead
(:mod:`gradscope.recorder.capture.norm_edges`, no second run), and the norm is run again
only where no such edge is found. A tap on the input would instead change how autograd
sums the input's gradient (the norm reads it twice) and so change training in the last bit;
the copy changes nothing of the user's: its input tap gives the input no gradient, its
parameters are detached, it runs the module's own ``forward`` without its hooks, and it is
built only in recorded steps. It costs a norm's forward and backward more per call.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from gradscope.recorder.capture.taps import first_tensor
from gradscope.recorder.discovery.module_class import own_class


class NormAlone(nn.Module):
    """One norm's own ``forward``, without the module's hooks, to be run with detached parameters.

    Args:
        norm: the normalisation module (a module of the user's model; held, not changed).
    """

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        # its class's own forward (no hooks, not armed), looked up here once: read inside a compiled
        # forward, the registry of swapped classes would be guarded on by Dynamo, key by key, and a
        # Recorder collected while another compiles shrinks it under the guard being built
        self._own_forward = own_class(norm).forward

    def forward(self, *args, **kwargs):
        return self._own_forward(self.norm, *args, **kwargs)

    def run(self, args: tuple, kwargs: dict, where: int | str, x: torch.Tensor) -> torch.Tensor | None:
        """The norm's output for the call ``(args, kwargs)`` with ``x`` in place of its main
        input (at position or keyword ``where``), computed with its parameters and every
        other tensor of the call detached (an adaptive norm's condition gets no gradient
        from the copy)."""
        args = tuple(_detached(a) for a in args)
        kwargs = {k: _detached(v) for k, v in kwargs.items()}
        if isinstance(where, int):
            args = (*args[:where], x, *args[where + 1:])
        else:
            kwargs = {**kwargs, where: x}
        params = {f"norm.{name}": p.detach() for name, p in self.norm.named_parameters()}
        return first_tensor(functional_call(self, params, args, kwargs))


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else value
