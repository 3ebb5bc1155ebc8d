"""``History``: the store of a run trained without a recorder, a recorder with no model quantities.

``train`` logs its rows (``loss``, ``lr``, ``val_loss``, ``val_accuracy``) into one store: the recorder it was
given, or a ``History`` when it was given none, or a recorder that keeps no rows (one with only
a ``step`` context, such as a callback). A ``History`` answers the same protocol as
``gradscope.Recorder`` (``step``, ``log``, ``frame``, ``state_dict``/``load_state_dict``);
it hands ``step`` and ``log`` on to the wrapped hooks object, when there is one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pandas as pd

from gradscope.table import make_frame
from gradscope.train.optim import LOSS_REDUCTION

# The rows the loop logs, and the loss reduction each states (lr is not a loss: "").
LOOP_QUANTITIES: dict[str, str] = {"loss": LOSS_REDUCTION, "lr": "", "val_loss": LOSS_REDUCTION,
                                   "val_accuracy": LOSS_REDUCTION}  # (token accuracy: a mean over target tokens)


class History:
    """The loop's rows of one run, kept on the host.

    Args:
        run: value of the ``run`` column.
        variant: value of the ``variant`` column.
        hooks: an object with a ``step(step)`` context (and optionally ``log``,
            ``attach_optimizer``, ``state_dict``/``load_state_dict``) that keeps no rows
            itself; its calls are passed on.
    """

    def __init__(self, *, run: str = "run", variant: str = "", hooks: Any = None) -> None:
        self.run, self.variant, self.hooks = run, variant, hooks
        self._rows: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """The hooks' step context, or nothing."""
        with self.hooks.step(step) if self.hooks is not None else contextlib.nullcontext():
            yield

    def log(self, quantity: str, value: float, *, step: int) -> None:
        """Keeps one row (``quantity`` at ``step``) and passes it to the hooks' ``log``."""
        self._rows.append({"run": self.run, "variant": self.variant, "step": step, "quantity": quantity,
                           "value": float(value), "reduction": LOOP_QUANTITIES.get(quantity, LOSS_REDUCTION)})
        log = getattr(self.hooks, "log", None)
        if log is not None:
            log(quantity, value, step=step)

    def attach_optimizer(self, optimizer) -> None:
        """Passed on to the hooks, if they take it."""
        if hasattr(self.hooks, "attach_optimizer"):
            self.hooks.attach_optimizer(optimizer)

    def frame(self) -> pd.DataFrame:
        """The rows as the tidy table of ``gradscope.table``."""
        return make_frame(self._rows)

    def state_dict(self) -> dict[str, Any]:
        """The rows (and the hooks' state), for checkpoints."""
        state: dict[str, Any] = {"rows": list(self._rows)}
        if hasattr(self.hooks, "state_dict"):
            state["hooks"] = self.hooks.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` saved."""
        self._rows = list(state["rows"])
        if "hooks" in state and hasattr(self.hooks, "load_state_dict"):
            self.hooks.load_state_dict(state["hooks"])


def keeps_rows(recorder: Any) -> bool:
    """Whether ``recorder`` is a store (``log`` and ``frame``, as ``gradscope.Recorder``)."""
    return callable(getattr(recorder, "log", None)) and callable(getattr(recorder, "frame", None))
