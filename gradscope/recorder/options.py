"""The Recorder's less common settings, grouped: :class:`RecorderOptions`."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields

from torch import nn


@dataclass(frozen=True)
class RecorderOptions:
    """Settings most runs leave alone (``Recorder(model, options=RecorderOptions(...))``).

    Attributes:
        variant: value of the ``variant`` column (default: the zoo config's variant, or the
            model's class name).
        rank: value of the ``rank`` column (default: the torch.distributed rank, else 0).
        reduction: how the loss is reduced over tokens, ``"mean"`` or ``"sum"``, written to
            every row (:func:`gradscope.distributed.global_rows` combines ranks by it).
        cosine_tokens: tokens sampled per stack for ``cosine`` (stratified over the batch).
        max_calls: rows kept per site for a module called several times in one forward (a
            shared layer): ``site``, ``site#2``, ... (later calls add into the last, and a
            warning says so).
        seed: seed of the recorder's private token-sampling generator.
    """

    variant: str | None = None
    rank: int | None = None
    reduction: str = "mean"
    cosine_tokens: int = 256
    max_calls: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("cosine_tokens", "max_calls"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RecorderOptions.{name}: must be an integer >= 1, got {value!r}")
        if self.reduction not in ("mean", "sum"):
            raise ValueError(f"RecorderOptions.reduction: must be 'mean' or 'sum', got {self.reduction!r}")


OPTION_NAMES = tuple(f.name for f in fields(RecorderOptions))


def moved_options(kwargs: dict) -> RecorderOptions | None:
    """Raises TypeError for a keyword the Recorder does not take, naming where it went
    (the fields of :class:`RecorderOptions` were constructor keywords before)."""
    if not kwargs:
        return None
    moved = sorted(k for k in kwargs if k in OPTION_NAMES)
    if moved:
        args = ", ".join(f"{k}={kwargs[k]!r}" for k in moved)
        raise TypeError(f"Recorder: {moved} moved into options: Recorder(model, options=gradscope.RecorderOptions({args}))")
    raise TypeError(f"Recorder: unknown keyword(s) {sorted(kwargs)}")


def positional_names(model: nn.Module) -> list[str]:
    """Names of ``model.forward``'s positional parameters, in order (so that a mask passed
    by position is found without inspecting anything during a traced forward)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
