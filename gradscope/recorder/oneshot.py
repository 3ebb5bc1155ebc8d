"""One-step helpers over :class:`~gradscope.recorder.recorder.Recorder`: ``record`` and ``snapshot``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pandas as pd
from torch import nn

from gradscope.recorder.recorder import Recorder


@contextlib.contextmanager
def record(model: nn.Module, *, step: int = 0, **kwargs) -> Iterator[Recorder]:
    """One recorded step as a context: ``with gradscope.record(model) as rec: loss.backward()``.

    Covers forward and backward; every hook is removed on exit, exceptions included.
    Keyword arguments go to :class:`Recorder`.
    """
    rec = Recorder(model, **kwargs)
    try:
        with rec.step(step):
            yield rec
    finally:
        rec.close()


def snapshot(model: nn.Module, inputs: tuple | dict, loss_fn, *, quantities="all", **kwargs) -> pd.DataFrame:
    """All quantities for one forward/backward, e.g. at the start of training.

    Parameter gradients that existed before are restored afterwards. The forward runs in
    the model's current mode, as any forward would: in training mode a BatchNorm updates
    its running statistics and dropout draws from the global RNG (call ``model.eval()``
    first, or ``torch.random.fork_rng()``, to leave them untouched).

    Args:
        model: the model.
        inputs: the model's positional inputs (``(src, tgt_in)`` or ``(tokens,)``), or a
            dict of keyword inputs (``{"input_ids": ids, "attention_mask": mask}``).
        loss_fn: ``loss_fn(output) -> scalar loss``.
        quantities: as for :class:`Recorder` (default ``"all"``, cosine included).
        **kwargs: more :class:`Recorder` arguments.

    Returns:
        The tidy table of that step (step 0).
    """
    saved = {p: p.grad for p in model.parameters()}
    for p in saved:
        p.grad = None
    try:
        with record(model, quantities=quantities, slow_every=1, **kwargs) as rec:
            loss = loss_fn(model(**inputs) if isinstance(inputs, dict) else model(*inputs))
            loss.backward()
            rec.log("loss", loss)
        return rec.frame()
    finally:
        for p, g in saved.items():
            p.grad = g
