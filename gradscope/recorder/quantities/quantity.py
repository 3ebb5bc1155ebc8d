"""The Quantity contract: everything about one quantity in its class.

A quantity says what it captures, when it is taken, how its values become table rows, how
ranks combine them, whether ``spike`` watches it, and what it is in one line. The built-in
quantities (:mod:`gradscope.recorder.quantities.registry`) and a user's own are the same kind of
object; the Recorder takes instances::

    class MaxAbs(gradscope.Quantity):
        name = "act_max_abs"
        description = "max |h| over the tensor crossing a site"
        over_micro_steps = across_ranks = "max"

        def site_value(self, h):
            return h.abs().amax().float()

    rec = gradscope.Recorder(model, quantities=["act_grad_norm", MaxAbs()])

There are three ways to take values, and a quantity uses any of them:

- per site, in the graph: :meth:`Quantity.site_value` (a 0-d statistic of the tensor
  crossing each site in the forward) and :meth:`Quantity.site_grad` (of the gradient
  ∂loss/∂h at each site in the backward). They run inside the model's forward and
  backward, eagerly or traced by ``torch.compile`` (write them with traceable tensor ops,
  no ``.item()``), once per micro-step; the rows come from :meth:`Quantity.rows`' default;
- at the end of the step, on the device: :meth:`Quantity.collect` with a
  :class:`~gradscope.recorder.quantities.context.StepContext` (parameters, gradients, optimizer, the
  built-in captures), adding 0-d tensors under row keys;
- from the built-in captures (``captures``), as the built-in quantities do.

Values reach the host once per recorded step, for every quantity together.
"""

from __future__ import annotations

import difflib
import re
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from gradscope.recorder.quantities.combine import COMBINE, Row
from gradscope.table.keys import Key

if TYPE_CHECKING:  # type hints only
    from gradscope.recorder.discovery.layout import Layout
    from gradscope.recorder.quantities.context import StepContext
    from gradscope.recorder.quantities.step_data import StepData

CAPTURES: tuple[str, ...] = ("value", "grad", "wsig", "cosine", "attention", "rms", "logits", "router")
"""The built-in in-graph captures a quantity may name in ``captures``: a site's forward
norm, the sites' gradient norms, norms' w/σ, sampled layer outputs, attention logits,
sub-layer RMS, output logits, MoE routers' outputs (:mod:`gradscope.recorder.capture.capture`)."""

RANK_RULES: tuple[str, ...] = (*COMBINE, "gradient_norm", "loss", "shared", "local")
"""How :func:`gradscope.distributed.global_rows` combines a quantity over ranks:
:data:`COMBINE`, or ``gradient_norm`` (rss, divided by the number of ranks for a
mean-reduced loss), ``loss`` (mean or sum as the loss was reduced), ``shared`` (every rank
holds the global value: the lowest rank's is copied), ``local`` (not combined: a ratio or
a sampled statistic)."""


class Quantity:
    """Base class of every quantity, built-in or written by a user.

    Its class attributes say what it is; a subclass overrides them.

    Attributes:
        name: the ``quantity`` column of its rows (lower case, unique).
        description: one line, shown in the quantity reference.
        paper: where it comes from (author year, figure or equation), or ``""``.
        captures: built-in in-graph captures it reads (:data:`CAPTURES`).
        slow: taken only every ``slow_every`` recorded steps (costly or slowly changing).
        needs_backward: reads gradients; a step whose backward did not run inside it gets
            no rows of it (and a warning).
        across_ranks: how ranks combine it (:data:`RANK_RULES`).
        spike_watched: whether the ``spike`` quantity watches its per-step series.
        over_micro_steps: how a per-site statistic's micro-steps combine into the step's
            row (:data:`COMBINE`).
        also_names: other ``quantity`` values its rows carry (``nonfinite`` writes
            ``nonfinite_grad`` rows too).
        logged: its values come from ``rec.log(name, value)`` in the training loop.
        reads_param_grads: its :meth:`collect` reads ``p.grad``, which a GradScaler scales:
            its values are divided by the scale unless the loop unscaled the gradients first
            (a step where that is not known gets no rows of it, and a warning).
        taken: when its rows are written, for the quantity reference, when that is not the
            schedule's (``""``: every recorded step, or every ``slow_every``-th for a slow one).
        site_value_size: how many numbers :meth:`site_value` returns (1: a 0-d tensor); a
            quantity that returns several (moments to combine exactly, as ``act_kurtosis``)
            writes its own :meth:`rows`, and reads ``data.user_values[name]`` as (M, taps, size).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    captures: ClassVar[frozenset[str]] = frozenset()
    slow: ClassVar[bool] = False
    needs_backward: ClassVar[bool] = False
    across_ranks: ClassVar[str] = "local"
    spike_watched: ClassVar[bool] = False
    over_micro_steps: ClassVar[str] = "rss"
    also_names: ClassVar[tuple[str, ...]] = ()
    logged: ClassVar[bool] = False
    reads_param_grads: ClassVar[bool] = False
    taken: ClassVar[str] = ""
    site_value_size: ClassVar[int] = 1

    # -- per site, inside the graph --------------------------------------------------------
    def site_value(self, h: torch.Tensor) -> torch.Tensor | None:
        """A 0-d statistic of the tensor ``h`` crossing a site in the forward (detached),
        or None (the default) when the quantity takes none. Traceable ops only."""
        return None

    def site_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        """A 0-d statistic of ∂loss/∂h at a site, taken in the backward, or None (the
        default). Traceable ops only. At the input of a norm it is the gradient through
        that norm alone, as for ``act_grad_norm``."""
        return None

    # -- at the end of the step ----------------------------------------------------------------
    def collect(self, ctx: StepContext) -> None:
        """Device work at the end of a recorded step, after backward and before the loop's
        ``optimizer.step()``: add values under this quantity's name with
        ``ctx.add(key, tensor)`` and friends (:class:`~gradscope.recorder.quantities.context.StepContext`)."""

    def rows(self, data: StepData) -> list[Row]:
        """The step's table rows, from the values on the host.

        The default gives what :meth:`collect` added, and one row per site and call for
        :meth:`site_value` / :meth:`site_grad` (per micro-step too when there were several,
        and the step's row combined by ``over_micro_steps``).
        """
        rows = list(data.collected.get(self.name, []))
        single = ~data.merged if data.merged is not None else True  # (slots of several calls in a micro-step: none)
        if self.takes_site_values:  # (a later call's value replaced an earlier one's)
            rows += data.site_rows(self.name, data.user_values[self.name], data.value_called & single,
                                   self.over_micro_steps)
        if self.takes_site_grads:  # (the calls' values were added: right for a sum only)
            got = data.got if self.over_micro_steps == "sum" else data.got & single
            rows += data.site_rows(self.name, data.user_grads[self.name], got, self.over_micro_steps)
        return rows

    def merged_away(self, data: StepData) -> bool:
        """Whether :meth:`rows`' default leaves out slots of ``data`` that took several
        calls in one micro-step (the Recorder warns)."""
        if data.merged is None or not data.merged.any() or type(self).rows is not Quantity.rows:
            return False
        return self.takes_site_values or (self.takes_site_grads and self.over_micro_steps != "sum")

    def nothing_to_measure(self, layout: Layout) -> str | None:
        """Why this quantity has nothing to measure in a model of this layout (``"the model
        has no normalisation layer"``), or None (the default). A Recorder asked for it by
        name warns once with the reason."""
        return None

    # -- what the Recorder asks --------------------------------------------------------------
    @property
    def takes_site_values(self) -> bool:
        """Whether the subclass defines :meth:`site_value`."""
        return type(self).site_value is not Quantity.site_value

    @property
    def takes_site_grads(self) -> bool:
        """Whether the subclass defines :meth:`site_grad`."""
        return type(self).site_grad is not Quantity.site_grad

    @property
    def names(self) -> tuple[str, ...]:
        """Every ``quantity`` value its rows may carry."""
        return (self.name, *self.also_names)

    def check(self) -> None:
        """Raises ValueError naming the attribute that breaks the contract."""
        kind = type(self).__name__
        if not isinstance(self.name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(f"{kind}.name: lower case letters, digits and '_', starting with a letter "
                             f"(as the built-in 'act_grad_norm'), got {self.name!r}")
        acts = [m for m in ("site_value", "site_grad", "collect", "rows")
                if getattr(type(self), m) is not getattr(Quantity, m)]
        if not (acts or self.captures or self.logged):
            own = [a for a in vars(type(self)) if not a.startswith("_")]
            close = sorted({c for a in own for c in difflib.get_close_matches(a, ["site_value", "site_grad", "collect", "rows"])})
            hint = f" (did you mean {close}?)" if close else ""
            raise ValueError(f"{kind}: defines none of site_value, site_grad, collect or rows, so it would record "
                             f"nothing{hint}")
        if self.takes_site_values and self.takes_site_grads and type(self).rows is Quantity.rows:
            raise ValueError(f"{kind}: defines both site_value and site_grad, whose rows would both be quantity "
                             f"{self.name!r} at the same sites and could not be told apart: make two quantities, "
                             "one with each (or write rows() to name them)")
        if isinstance(self.captures, str):  # (set("value") would be its letters)
            raise ValueError(f"{kind}.captures: a set of capture names, as frozenset({{{self.captures!r}}}), got the "
                             f"string {self.captures!r}; valid names: {list(CAPTURES)}")
        bad = sorted(set(self.captures) - set(CAPTURES))
        if bad:
            raise ValueError(f"{kind}.captures: unknown {bad}; valid: {list(CAPTURES)}")
        size = self.site_value_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{kind}.site_value_size: a positive int (numbers site_value returns), got {size!r}")
        if size > 1 and type(self).rows is Quantity.rows:
            raise ValueError(f"{kind}.site_value_size is {size}: its site_value returns {size} numbers per site, "
                             "which the default rows() cannot tell apart: write rows() to combine them")
        if self.across_ranks not in RANK_RULES:
            raise ValueError(f"{kind}.across_ranks: {self.across_ranks!r}; valid: {list(RANK_RULES)}")
        if self.over_micro_steps not in COMBINE:
            raise ValueError(f"{kind}.over_micro_steps: {self.over_micro_steps!r}; valid: {list(COMBINE)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def checked_rows(quantity: Quantity, rows: list) -> list[Row]:
    """``quantity.rows(data)``'s result, checked when the quantity is a user's (a class
    defined outside gradscope): a list of (:class:`~gradscope.table.keys.Key`, number)
    pairs. A wrong row would otherwise pass the step and break every later ``frame()``.

    Raises:
        TypeError: naming the quantity and the first bad row.
    """
    if type(quantity).__module__.startswith("gradscope."):
        return rows
    if not isinstance(rows, list):
        raise TypeError(f"{type(quantity).__name__}.rows: must return a list of (Key, float) rows, got "
                        f"{type(rows).__name__}")
    for i, row in enumerate(rows):
        ok = (isinstance(row, tuple) and len(row) == 2 and isinstance(row[0], Key)
              and isinstance(row[1], (int, float, np.integer, np.floating)) and not isinstance(row[1], bool))
        if not ok:
            raise TypeError(f"{type(quantity).__name__}.rows: row {i} is {row!r}; each row is (Key, float), as "
                            "data.site_rows(...) and the keys of collect() give them (gradscope.table.keys.Key)")
    return rows
