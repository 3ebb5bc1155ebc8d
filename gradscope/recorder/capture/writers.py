"""The two ways a hook writes what it captured: traced by Dynamo, or run eagerly.

Every hook of :class:`~gradscope.recorder.capture.capture.Capture` asks once which writer applies
(:meth:`Capture.writer`) and then only talks to it:

- :class:`TracedWriter` (inside ``torch.compile``): every value goes into the device
  buffers with in-place writes, and every gradient through a :class:`Tap` whose backward
  writes into the collector's gradient, so the whole capture is part of the graph;
- :class:`EagerWriter`: order marks stay on the host, values wait as 0-d tensors until
  the snapshot gathers them in one write, and gradients are read by the cheapest exact
  hook (:mod:`gradscope.recorder.capture.eager`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

import torch

from gradscope.recorder.capture.buffer_layout import ORDER, VALUE
from gradscope.recorder.capture.eager import joined, node_hook_reads
from gradscope.recorder.capture.norm_edges import hook_edges, sequence_number
from gradscope.recorder.numerics.squared_norms import NormBatch, Reused, squared_norm
from gradscope.recorder.capture.taps import InputTap, JoinTap, NormTap, Tap

class TracedWriter:
    """Writes of a hook traced by Dynamo: all on the device, inside the graph."""

    traced = True

    def __init__(self, capture) -> None:  # (the Capture whose buffers it writes: capture/capture.py)
        self.capture = capture

    def call(self, i: int) -> tuple[int, bool]:
        """(call slot, inside a recompute) of counter ``i``: traced, never a recompute."""
        return self.capture.next_call(i), False

    def mark(self, slot: int, order: float) -> None:
        self._write(slot, ORDER, torch.full((1,), order, device=self.capture.fwd.device))

    def put(self, slot: int, channel: int, value: torch.Tensor) -> None:
        self._write(slot, channel, value.reshape(1))

    def value(self, slot: int, t: torch.Tensor) -> None:
        """‖t‖² added into the value channel (the snapshot takes the square root: every
        forward of a micro-step counts, as its gradients do)."""
        self._write(slot, VALUE, squared_norm(t).reshape(1), accumulate=True)

    def _write(self, slot: int, channel: int, value: torch.Tensor, accumulate: bool = False) -> None:
        """``fwd[slot, channel] = value`` (or ``+=``) as ``index_put_``: Inductor writes that
        one element, where the indexing assignment became a pass over the whole (n_slots ×
        width) buffer for every write (≈300 per forward: a 0.2 ms kernel in a d=16 compiled forward)."""
        fwd = self.capture.fwd
        fwd.index_put_((torch.full((1,), slot, device=fwd.device), torch.full((1,), channel, device=fwd.device)),
                       value.to(fwd.dtype), accumulate=accumulate)

    def tap(self, i: int, t: torch.Tensor, slot: int, recompute: bool, module_args: tuple) -> torch.Tensor:
        """The tapped value whose backward writes ‖grad‖² (and user statistics) into the collector."""
        c = self.capture
        collector, at = c.traced_slot(slot)
        return c.passed_on(t, Tap.apply(t, collector, at, None, c.grad_stats_now))

    def norm_tap(self, y, x, slot: int, kind, w, is_ln, eps, dims) -> torch.Tensor:
        c = self.capture
        collector, at = c.traced_slot(slot)
        return NormTap.apply(y, x, collector, at, kind, w, is_ln, eps, dims, None, c.grad_stats_now)

    def begin_norm(self, j: int) -> None:
        """Norm ``j``'s call begins (its pre-hook): traced, nothing to note."""

    def alone_tap(self, y: torch.Tensor, x: torch.Tensor, slot: int, run_alone, j: int) -> torch.Tensor | None:
        """``y`` joined to the norm run again alone on a tap of its input ``x`` (``run_alone``),
        whose backward writes the gradient through the norm alone at ``slot`` (``j``: the norm)."""
        c = self.capture
        collector, at = c.traced_slot(slot)
        return JoinTap.apply(y, run_alone(InputTap.apply(x, collector, at, None, c.grad_stats_now)))


class EagerWriter(TracedWriter):
    """Writes of a hook run eagerly: host marks, pending values, node hooks where exact. It
    holds what the micro-step's eager calls wrote until the capture's snapshot takes it
    (:meth:`write_into`)."""

    traced = False

    def __init__(self, capture, n_slots: int) -> None:
        super().__init__(capture)
        # order marks on the host, one per slot. An array of doubles: setting an item costs a third
        # of a numpy array's (25 against 80 ns), and numpy reads it without a copy when the rows
        # are built (a list took 40 µs a snapshot)
        self._no_marks = bytes(8 * n_slots)
        self.marks = array("d", self._no_marks)
        self.pending_fwd: list[tuple[int, int, torch.Tensor]] = []  # (slot, channel, 0-d value)
        self.pending_sq: list[tuple[int, torch.Tensor]] = []  # (slot, 0-d ‖h‖²): site values
        self.value_sq = Reused()  # ‖h‖² once for a value two sites receive in a row
        self.values = NormBatch()  # site values of a model that promises no in-place op after a site
        self.norm_start: dict[int, int] = {}  # norm -> the autograd sequence number when its last call began

    def new_marks(self) -> None:
        """A recorded step begins: no slot marked."""
        self.marks = array("d", self._no_marks)

    def clear(self) -> None:
        """Drops what the micro-step's calls wrote (the step is discarded)."""
        self.pending_fwd.clear()
        self.pending_sq.clear()
        self.values.clear()

    def holds_values(self) -> bool:
        """Whether calls wrote values that no snapshot took yet."""
        return bool(self.pending_fwd or self.pending_sq)

    def passed_on(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (the tapped ``t``) goes on: the next site often receives this very tensor."""
        self.value_sq.passed_on(t, out)
        self.values.passed_on(t, out)

    def write_into(self, fwd: torch.Tensor, index: Callable[[list[int], int], torch.Tensor]) -> array:
        """Writes the micro-step's pending values into its forward buffer ``fwd`` (``index``:
        the capture's slot indices on the device) and returns its marks; then starts afresh."""
        if self.pending_fwd:
            rows = torch.tensor([s for s, _, _ in self.pending_fwd], device=fwd.device)
            cols = torch.tensor([c for _, c, _ in self.pending_fwd], device=fwd.device)
            fwd.index_put_((rows, cols), torch.stack([v if v.dtype is torch.float32 else v.float()  # (no dispatch for fp32)
                                                      for _, _, v in self.pending_fwd]))
        slots, sq = joined(*self.values.take(), self.pending_sq)
        if slots:  # (‖h‖² added: a slot that several forwards of the micro-step wrote holds their sum)
            fwd.view(-1).index_add_(0, index(slots, 1), sq.to(fwd.device))
        # (the sites' ‖h‖² go to the host as they are, the square roots taken with the rows: host_rows.step_rows)
        marks = self.marks  # (the snapshot's from now)
        self.new_marks()
        self.clear()
        self.value_sq.clear()  # (recompute counts run on: reentrant checkpointing's inner backwards end here too)
        return marks

    def call(self, i: int) -> tuple[int, bool]:
        c = self.capture
        if torch._C._current_autograd_node() is not None:  # activation checkpointing recomputes
            return c.next_recall(i), True
        return c.next_call(i), False

    def mark(self, slot: int, order: float) -> None:
        self.marks[slot] = order

    def put(self, slot: int, channel: int, value: torch.Tensor) -> None:
        self.pending_fwd.append((slot, channel, value))

    def value(self, slot: int, t: torch.Tensor) -> None:
        """‖t‖² for the snapshot (added to the slot's, one square root for all): of a model that promises no
        in-place op after a site (``site_outputs_never_modified_in_place``), ``t`` itself
        waits and is reduced with the others; otherwise it is reduced now, as a later
        in-place op would change it. A site that receives the very tensor (same version)
        the last site passed on reuses it (a layer's ``out`` is the next layer's ``in``)."""
        if self.capture.promised:  # no in-place op can follow: reduced later, a stack at a time
            self.values.add(slot, t)
        else:
            self.pending_sq.append((slot, self.value_sq(t)))

    def tap(self, i: int, t: torch.Tensor, slot: int, recompute: bool, module_args: tuple) -> torch.Tensor | None:
        """A node hook where it reads the same gradient (None: the value is kept), else an
        alias or the Tap (:mod:`gradscope.recorder.capture.eager`)."""
        c = self.capture
        if c.hooked[i] and node_hook_reads(t, *module_args):
            c.eager.hook(t, slot, recompute)
            return None
        if c.alias[i]:
            out = t[...]  # aten.alias (a new autograd node that hands the gradient on unchanged), by indexing's fast path
            c.eager.retain(out, slot, recompute)
            return c.passed_on(t, out)
        return c.passed_on(t, Tap.apply(t, c.collector, slot, c.eager, ()))

    def norm_tap(self, y, x, slot: int, kind, w, is_ln, eps, dims) -> torch.Tensor:
        c = self.capture
        return NormTap.apply(y, x, c.collector, slot, kind, w, is_ln, eps, dims, c.eager, ())

    def begin_norm(self, j: int) -> None:
        self.norm_start[j] = sequence_number()

    def alone_tap(self, y: torch.Tensor, x: torch.Tensor, slot: int, run_alone, j: int) -> torch.Tensor | None:
        """None when hooks on the edges from the norm's own nodes into ``x`` read the gradient
        through it alone (:mod:`gradscope.recorder.capture.norm_edges`); else the norm run again."""
        c = self.capture
        start = self.norm_start.pop(j, None)
        if start is not None and hook_edges(c.eager, y, x, start, slot):
            return None
        return JoinTap.apply(y, run_alone(InputTap.apply(x, c.collector, slot, c.eager, ())))
