"""Capture inside the graph: identity taps at the sites, statistics into device buffers.

Hooks are installed once, when the Recorder is made, and removed by ``close()``; on a step
that is not recorded each hook returns at once. On a recorded step:

- a site's value passes through :class:`Tap`, an identity ``autograd.Function`` whose
  backward also returns ‖grad‖² as the gradient of a small *collector* leaf vector, one slot
  per (site, call). Autograd sums those into ``collector.grad``, so every activation-gradient
  norm of a backward arrives in one vector, with no Python hook in the backward and no
  host sync. The tap's output is a detached alias of its input (same storage, same version
  counter), so an in-place op after a site behaves exactly as without the recorder;
- run eagerly (not traced), a module's output is read more cheaply where that is exact: by
  a pre-hook on the autograd node that made it, or on an alias of it
  (:mod:`gradscope.recorder.capture.eager` says when). Other module inputs keep the Tap, whose
  gradient is the one through that module alone;
- forward statistics (the site's ‖h‖, a norm's w/σ, sampled rows for ``cosine``) are
  written in place into device buffers;
- when ``collector.grad`` is accumulated (the end of each backward) one hook copies it and the
  forward buffer aside: one snapshot per micro-step.

Everything a hook does is traceable by Dynamo, so ``torch.compile(model, fullgraph=True)``
works with no graph break; whether a step records is a Python flag, so recorded and
unrecorded steps compile one graph each and then never again. Nothing is re-run, nothing
draws from the global RNG, no buffer of the user's is touched, and values reach the host
once per recorded step.

A module called several times in one forward (a shared layer) gets one slot per call, up
to ``max_calls``; later calls add into the last slot (and the Recorder warns).
"""

from __future__ import annotations

import itertools
import weakref
from array import array
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from gradscope.recorder.capture.cosine_rows import CosineRows
from gradscope.recorder.capture.eager import EagerGrads, joined
from gradscope.recorder.capture.hookset import HookSet
from gradscope.recorder.discovery.layout import Layout
from gradscope.recorder.capture.observe import FWD, SiteObserver
from gradscope.recorder.capture.signals import Signals
from gradscope.recorder.capture.site_plan import fully_sharded, plan_sites
from gradscope.recorder.capture.site_hooks import (_KINDS, _LIVE, _KEYS, GRAD_EXPECTED, TAPPED, _input_hook, _norm_hook,
                                             _output_hook, _root_hook, _tag, _tagged, forget)
from gradscope.recorder.numerics.squared_norms import NormBatch, Reused
from gradscope.recorder.capture.taps import in_backward
from gradscope.recorder.capture.writers import EagerWriter, TracedWriter

REACHED, REACHED_IF_TAPPED = 1, 2  # a slot's gradient arrived; a compiled backward ran (see Capture.snapshot)


class Capture(SiteObserver):
    """The permanent hooks of a Recorder and the device buffers they write.

    Args:
        model: the recorded model (its root forward resets the per-forward call counts).
        layout: sites, norms and stacks.
        max_calls: slots per site for a module called several times per forward.
        token_masks: callable (args, kwargs) -> {stack: (B, T) bool} for ``cosine`` weights.
        value_stats: user statistics of a site's forward value (quantities' ``site_value``):
            forward-buffer channel ``FWD + k``.
        grad_stats: user statistics of a site's gradient (``site_grad``): collector slots
            ``slot + (k + 1)·n_taps``.
    """

    def __init__(self, model: nn.Module, layout: Layout, max_calls: int, token_masks, value_stats: tuple = (),
                 grad_stats: tuple = ()) -> None:
        self.model, self.layout, self.K, self.token_masks = model, layout, max_calls, token_masks
        # Every hook reads this Capture as ``_LIVE[key]``: traced by Dynamo, that is one source
        # for all hooks, so the compiled graph is guarded on the capture's state once rather
        # than once per hook through each hook's closure (≈7000 guards fewer for 180 hooks).
        self.key = next(_KEYS)
        _LIVE[self.key] = self
        self.points = list(layout.probes)
        self.n_taps = len(self.points) * max_calls
        self.value_stats, self.grad_stats = tuple(value_stats), tuple(grad_stats)
        self.width = FWD + len(self.value_stats)  # forward-buffer channels
        self.n_collector = self.n_taps * (1 + len(self.grad_stats))
        self.stats_now = False  # user statistics are taken in the open step
        self.grad_stats_now: tuple = ()
        self.n_slots = self.n_taps + len(layout.norms) * max_calls  # taps, then norms (w/σ)
        self.on = False
        self.want_value = self.want_grad = self.want_wsig = self.want_cosine = False
        self.n_counters = len(self.points) + len(layout.norms)
        # calls of each counter in this forward (a dict, empty when a forward begins: Dynamo
        # guards its keys once, where a list's items would be guarded one by one)
        self.calls: dict[int, int] = {}
        self.recalls = [0] * self.n_counters
        self.seq = 0
        self._at_snapshot: tuple[dict | None, int] = (None, 0)  # the call counters and their total at the last snapshot
        self.backwards = 0  # backwards seen in the open recorded step
        self.after_backward: Callable[[], None] | None = None  # told at the end of each backward of a recorded step
        self.grad_forwards = 0  # forwards of the open recorded step that ran with grad enabled
        self.forwards = 0  # forwards of the open recorded step, with grad or without
        self.device: torch.device | None = None
        self.collector: torch.Tensor | None = None
        self.first_calls: torch.Tensor | None = None  # the collector's slots of first calls (Capture.traced_slot)
        self.fwd: torch.Tensor | None = None  # (n_slots, width): [±order (negative: not tapped), value, misfit, user...]
        self._no_grads: torch.Tensor | None = None  # the collector's gradient of a backward that gave it none: zeros
        self._indices: list[tuple[list[int], torch.Tensor] | None] = [None, None]  # (slots, on the device): Capture._index
        self.cosine = CosineRows(layout)  # sampled stack-output rows for ``cosine``
        # per snapshot: (collector gradient, forward buffer, host marks, (every tap's arrival, slots that arrived))
        self.snapshots: list[tuple[torch.Tensor, torch.Tensor, array, tuple[int, list[int]]]] = []
        # eager fast path: marks on the host, values and gradient norms gathered per micro-step. An
        # array of doubles: setting an item costs a third of a numpy array's (25 against 80 ns), and
        # numpy reads it without a copy when the rows are built (a list took 40 µs a snapshot)
        self._no_marks = bytes(8 * self.n_slots)
        self.marks = array("d", self._no_marks)
        self.pending_fwd: list[tuple[int, int, torch.Tensor]] = []  # (slot, channel, 0-d value)
        self.pending_sq: list[tuple[int, torch.Tensor]] = []  # (slot, 0-d ‖h‖²): site values, eagerly
        self.value_sq = Reused()  # eagerly, ‖h‖² once for a value two sites receive in a row
        self.values = NormBatch()  # eagerly, site values of a model that promises no in-place op after a site
        self.eager = EagerGrads(self.snapshot, lambda: self.on, self.n_taps,  # eager gradient norms (node hooks, Taps' norms)
                                lambda slot: f"site {self.points[slot // self.K].name!r}")
        self._traced, self._eager_writer = TracedWriter(self), EagerWriter(self)
        plan = plan_sites(model, layout)  # how each site is read (recorder/site_plan.py)
        self._norm_kind, self._norm_in, self._taps = plan.norm_kind, plan.norm_in, plan.taps
        self.hooked, self.alias, self.promised, self._quick = plan.hooked, plan.alias, plan.promised, plan.quick
        self.grad_expected = plan.grad_expected  # whether a site's gradient arrives: its order mark's sign
        self._planned_under: type | None = None  # the root's class when ``begin`` last checked the plan
        self._quick_now = False  # this step takes no per-site user statistics and no cosine samples
        self.hooks = HookSet(armed=False, root=model)  # armed only while a step records (recorder/hookset.py)
        self.signals = Signals(model, layout, lambda: self.on)  # attention, sub-layer RMS and output-logit signals

    # -- installation -------------------------------------------------------------------
    def install(self, captures: frozenset[str] = frozenset()) -> None:
        """Registers every hook (once per Recorder); ``captures``: what the Recorder's
        quantities may capture (the forward signals' hooks are installed only if asked for)."""
        hooks = self.hooks
        hooks.forward_pre(self.model, _root_hook(self.key))
        for j, norm in enumerate(self.layout.norms):  # before the site taps: sees the norm's raw output
            hooks.forward(norm.module, *_tagged(_norm_hook, _tag(self.key, j, _KINDS.index(self._norm_kind[j]))))
        for i, p in enumerate(self.points):
            tagged = _tagged(_output_hook if p.where == "output" else _input_hook, _tag(self.key, i, self._site_flags(i)))
            if p.where == "output":
                hooks.forward(p.module, *tagged)
            else:
                hooks.forward_pre(p.module, *tagged)
        self.signals.install(hooks, attention="attention" in captures, rms="rms" in captures, logits="logits" in captures)
        hooks.run_eagerly_as_frames_of_their_own()

    def discard(self) -> None:
        """Disarms the hooks and drops what the open step captured so far."""
        self.on = False
        self.hooks.disarm()
        self.snapshots.clear()
        self.pending_fwd.clear()
        self.pending_sq.clear()
        self.values.clear()
        self.eager.reset_backward()
        self.eager.forget()

    def dropped(self) -> None:
        """Its Recorder was collected without ``close()``: the hooks are disarmed (an open
        step's too; what the step kept, as retained aliases holding its graph, goes) and
        read no more."""
        self.discard()
        forget(self.key)

    def remove(self) -> None:
        """Removes every hook and lets the buffers go."""
        self.discard()
        self.hooks.remove()
        self.signals.remove()
        self.collector = self.first_calls = self.fwd = self._no_grads = None
        forget(self.key)

    # -- per recorded step ----------------------------------------------------------------
    def begin(self, device: torch.device, captures: set[str] | frozenset[str], *, cosine_tokens: int,
              generator: torch.Generator, stats: bool = False) -> None:
        """Arms the hooks for one recorded step: ``captures`` names what the step's quantities
        capture (:data:`gradscope.recorder.quantities.quantity.CAPTURES`); ``stats``: take the user
        statistics."""
        value, grad, wsig, cosine = ("value" in captures, "grad" in captures, "wsig" in captures,
                                     "cosine" in captures)
        attention, rms, logits = "attention" in captures, "rms" in captures, "logits" in captures
        if self.device != device or self.collector is None:
            self.device = device
            self.collector = torch.zeros(self.n_collector, device=device, requires_grad=True)
            # (eager Taps hand the collector no gradient, yet its hook still runs once per backward;
            # it holds this Capture weakly: autograd keeps the hook from C++, where a strong
            # reference back to the collector's owner would be a cycle no collection finds, and
            # a Recorder dropped inside a step would leave its modules armed for good)
            self.collector.register_post_accumulate_grad_hook(partial(_collector_filled, weakref.ref(self)))
            with torch.enable_grad():  # (a step opened under no_grad still taps through it)
                self.first_calls = self.collector[::self.K]
            self.fwd = torch.zeros(self.n_slots, self.width, device=device)
            self._no_grads = torch.zeros(self.n_collector, device=device)
            self._indices = [None, None]
            self.cosine.forget()
        if type(self.model) is not self._planned_under:  # the root's class changed since the sites were planned
            self._planned_under = type(self.model)
            if any(self.alias) and fully_sharded(self.model):  # (fully_shard came after: no alias, site_plan.py)
                plan = plan_sites(self.model, self.layout)
                self.alias, self._quick = plan.alias, plan.quick
        self.collector.grad = None
        self.fwd.zero_()
        self.marks = array("d", self._no_marks)
        self.discard()
        self.want_value, self.want_wsig, self.want_cosine = value, wsig, cosine
        self.stats_now = stats and bool(self.value_stats or self.grad_stats)
        self.grad_stats_now = self.eager.stats = self.grad_stats if self.stats_now else ()
        self._quick_now = not (self.stats_now or cosine)
        self.want_grad = grad or bool(self.grad_stats_now)
        if cosine:
            self.cosine.begin(device, cosine_tokens, generator)
        self.calls = {}
        self.recalls = [0] * self.n_counters
        self.seq = 0
        self.backwards = self.grad_forwards = self.forwards = 0
        self.eager.begin()
        if attention or rms or logits:
            self.signals.begin(device, attention=attention, rms=rms, logits=logits)
        self.hooks.arm()
        self.on = True

    def end(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor, list[float], tuple[int, list[int]]]], list[int]]:
        """Disarms the hooks; returns the step's snapshots (‖grad‖² per tap, forward buffer,
        host marks, which gradients arrived), one per backward and a last one for forward work after the last
        backward, and the call counts."""
        if self.eager.unread():  # a backward whose end no hook saw: its gradients are its own micro-step
            self.snapshot()
        self.on = False
        self.hooks.disarm(self.eager.handles)
        self.signals.end()
        if not (self.snapshots and self._idle_since_snapshot()):  # (an empty last snapshot adds nothing: not taken)
            self.snapshot(backward=False)
        snapshots, self.snapshots = self.snapshots, []
        self.eager.forget()  # the retained aliases (and the graph they hold) go now, not at the next step
        return snapshots, list(map(self.calls.get, range(self.n_counters), itertools.repeat(0)))

    def snapshot(self, backward: bool = True) -> None:
        """Sets this micro-step's captures aside: at the end of a backward (the collector's
        gradient accumulated, or the eager taps' callback) and at the end of the step
        (``backward=False``). ``backwards`` counts the backwards of the open step."""
        if self.collector is None:  # closed (a graph kept past close() ran backward again)
            return
        if backward and self.on:
            self.backwards += 1
            if self.after_backward is not None:
                self.after_backward()
        grads = self.collector.grad
        # which gradients arrived (kept on the host, as arrays only when the rows are built:
        # host_marks): eagerly, the slots handed over; a compiled backward (the collector's
        # gradient) materialises zeros for sites it did not reach and cannot tell them, so it
        # marks every slot REACHED_IF_TAPPED
        every = 0 if grads is None else REACHED_IF_TAPPED
        if grads is None:  # (eagerly, always: one zero vector serves, as nothing writes into it)
            grads = self._no_grads
        self.collector.grad = None
        arrived, sq = self.eager.take()
        reached = (every, list(arrived))
        slots, sq = joined(arrived, sq, self.eager.pending)
        if slots:
            grads = grads.index_add(0, self._index(slots, 0), sq.to(self.device))
        fwd, self.fwd = self.fwd, torch.zeros_like(self.fwd)  # (the next micro-step writes into a fresh buffer)
        if self.pending_fwd:
            rows = torch.tensor([s for s, _, _ in self.pending_fwd], device=self.device)
            cols = torch.tensor([c for _, c, _ in self.pending_fwd], device=self.device)
            fwd.index_put_((rows, cols), torch.stack([v.float() for _, _, v in self.pending_fwd]))
        slots, sq = joined(*self.values.take(), self.pending_sq)
        if slots:  # (‖h‖² added: a slot that several forwards of the micro-step wrote holds their sum)
            fwd.view(-1).index_add_(0, self._index(slots, 1), sq.to(self.device))
        # (the sites' ‖h‖² go to the host as they are, the square roots taken with the rows: finish.step_rows)
        self.snapshots.append((grads, fwd, self.marks, reached))  # (the marks array is this snapshot's from now)
        self.marks = array("d", self._no_marks)
        self.pending_fwd.clear()
        self.pending_sq.clear()
        self.eager.reset_backward()
        self.values.clear()
        self.value_sq.clear()  # (recompute counts run on: reentrant checkpointing's inner backwards end here too)
        self._at_snapshot = (self.calls, sum(self.calls.values()))

    def _idle_since_snapshot(self) -> bool:
        """Whether no hook counted a call since the last snapshot (the call counters are the
        same dict with the same total: a forward starts a new one, and every site or norm call
        counts one, traced or eager) and no gradient came (the collector's, or an eager one;
        the caller has read the retained aliases' first): a snapshot now would hold zeros and
        no marks, which ``micro_steps`` drops."""
        seen, total = self._at_snapshot
        return (self.calls is seen and sum(self.calls.values()) == total and self.collector.grad is None
                and not (self.pending_fwd or self.pending_sq or self.eager.pending))

    def _index(self, slots: list[int], which: int) -> torch.Tensor:
        """The indices of ``slots`` on the device, reused while the slots come in the same order
        (they do, step after step): of the collector's gradient (``which`` 0), and of the value
        channel of the flattened forward buffer (1)."""
        cached = self._indices[which]
        if cached is None or cached[0] != slots:
            at = torch.tensor(slots, device=self.device)
            cached = self._indices[which] = (list(slots), at if which == 0 else at * self.width + 1)
        return cached[1]

    def traced_slot(self, slot: int) -> tuple[torch.Tensor, int]:
        """Where a traced tap writes ``slot``'s gradient statistics: (collector, position).

        A site's first call writes into :attr:`first_calls`, the strided view
        ``collector[::K]`` made with the collector, at position ``site`` (a user statistic
        ``k`` then lands at ``k·sites + site`` of the view, which is ``k·taps + slot`` of
        the collector); a later call of a shared module writes into the collector itself.
        The values and their places are the same either way. What changes is the compiled
        backward: Inductor fuses the taps' padded gradients into one kernel that visits,
        for every element of the vector they pad to, every tap writing into it. Over the whole
        collector (``max_calls`` = 16 slots a site) that was 2400 × 150 selects at d=16, one
        0.11 ms kernel in every recorded backward; over the view it is 150 × 150."""
        if slot % self.K:
            return self.collector, slot
        return self.first_calls, slot // self.K

    def writer(self) -> EagerWriter | TracedWriter:
        """How the calling hook writes: traced by Dynamo, or eagerly (asked once per hook call)."""
        if torch.compiler.is_compiling():
            return self._traced
        return self._eager_writer

    # -- hooks ----------------------------------------------------------------------------
    def _root_pre(self, module, args, kwargs):
        if not self.on:
            return None
        self.calls = {}
        self.recalls = [0] * self.n_counters
        self.seq = 0
        if not in_backward():  # (a checkpoint's recomputation during backward is the same forward)
            self.forwards += 1
        if torch.is_grad_enabled():
            self.grad_forwards += 1
        if self.want_cosine:
            self.cosine.masks = self.token_masks(args, kwargs)
        return None

    def next_call(self, i: int) -> int:
        """The slot (call index clipped to max_calls) of counter ``i``'s next forward call."""
        c = self.calls.get(i, 0)
        self.calls[i] = c + 1
        return min(c, self.K - 1)

    def next_recall(self, i: int) -> int:
        """The slot of a call that activation checkpointing recomputes (in reverse order of the forward)."""
        calls = max(self.calls.get(i, 0), 1)
        c = calls - 1 - self.recalls[i] % calls
        self.recalls[i] += 1
        return min(c, self.K - 1)

    def passed_on(self, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the tapped ``t``), noted: the next site often receives this very tensor."""
        self.value_sq.passed_on(t, out)
        self.values.passed_on(t, out)
        return out

    def _site_flags(self, i: int) -> int:
        return (TAPPED if self._taps[i] else 0) | (GRAD_EXPECTED if self.grad_expected[i] else 0)


def _collector_filled(capture: weakref.ref, collector: torch.Tensor) -> None:
    """The collector's gradient arrived (a backward ended): the capture, if it is still
    there, takes a snapshot."""
    cap = capture()
    if cap is not None and collector.grad is not None:
        cap.snapshot()
