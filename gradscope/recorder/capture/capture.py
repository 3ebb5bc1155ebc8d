"""The Capture: the state of a Recorder's permanent hooks and the device buffers they write
(how it works: :mod:`gradscope.recorder.capture`)."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from gradscope.recorder.capture.buffer_layout import FIRST_USER, MISFIT, REACHED_IF_TAPPED, VALUE, Arrivals, Snapshot
from gradscope.recorder.capture.cosine_rows import CosineRows
from gradscope.recorder.capture.eager import EagerGrads, joined
from gradscope.recorder.capture.hookset import HookSet
from gradscope.recorder.capture.norm_alone import NormAlone
from gradscope.recorder.capture.params import GradsSeen, ParamGroups, grads_seen
from gradscope.recorder.discovery.layout import Layout
from gradscope.recorder.capture.routers import RouterCapture
from gradscope.recorder.capture.signals import Signals
from gradscope.recorder.capture.site_plan import fully_sharded, plan_sites
from gradscope.recorder.capture.site_hooks import _KEYS, _LIVE, GRAD_EXPECTED, SITE_CAPTURES, TAPPED, forget, install_site_hooks
from gradscope.recorder.numerics.norm_stats import LOW_PRECISION, fit_norm, norm_gain, w_over_sigma
from gradscope.recorder.capture.taps import first_tensor, in_backward, main_input, replace_first, statistic
from gradscope.recorder.capture.writers import EagerWriter, TracedWriter


class Capture:
    """The permanent hooks of a Recorder and the device buffers they write.

    Args:
        model: the recorded model (its root forward resets the per-forward call counts).
        layout: sites, norms and stacks.
        max_calls: slots per site for a module called several times per forward.
        token_masks: callable (args, kwargs) -> {stack: (B, T) bool} for ``cosine`` weights.
        value_stats: user statistics of a site's forward value (quantities' ``site_value``):
            forward-buffer channels from ``FIRST_USER`` on, ``site_value_size`` of them each.
        grad_stats: user statistics of a site's gradient (``site_grad``): collector slots
            ``slot + (k + 1)·n_taps``.
        groups: the model's parameters (read where no site is hooked, to tell a backward).
    """

    def __init__(self, model: nn.Module, layout: Layout, max_calls: int, token_masks, value_stats: tuple = (),
                 grad_stats: tuple = (), *, groups: ParamGroups) -> None:
        self.model, self.layout, self.K, self.token_masks, self.groups = model, layout, max_calls, token_masks, groups
        # Every hook reads this Capture as ``_LIVE[key]``: traced by Dynamo, one source for all hooks, so the
        # graph is guarded on its state once, not per hook's closure (≈7000 guards fewer for 180 hooks)
        self.key = next(_KEYS)
        _LIVE[self.key] = self
        self.sites = list(layout.sites)
        self.n_taps = len(self.sites) * max_calls
        self.value_stats, self.grad_stats = tuple(value_stats), tuple(grad_stats)
        self.value_sizes = tuple(getattr(getattr(f, "__self__", None), "site_value_size", 1) for f in self.value_stats)
        self.width = FIRST_USER + sum(self.value_sizes)  # forward-buffer channels
        self.n_collector = self.n_taps * (1 + len(self.grad_stats))
        self.stats_now = False  # user statistics are taken in the open step
        self.grad_stats_now: tuple = ()
        self.n_slots = self.n_taps + len(layout.norms) * max_calls  # taps, then norms (w/σ)
        self.on = False
        self.want_value = self.want_grad = self.want_wsig = self.want_cosine = False
        self.n_counters = len(self.sites) + len(layout.norms)
        # calls of each counter in this forward (a dict, empty when a forward begins: Dynamo guards its keys once)
        self.calls: dict[int, int] = {}
        self.recalls = [0] * self.n_counters
        self.seq = 0
        self._at_snapshot: tuple[dict | None, int] = (None, 0)  # the call counters and their total at the last snapshot
        self.backwards = 0  # backwards seen in the open recorded step
        self.after_backward: Callable[[], None] | None = None  # told at the end of each backward of a recorded step
        self.grad_forwards = 0  # forwards of the open recorded step that ran with grad enabled
        self.forwards = 0  # forwards of the open recorded step, with grad or without
        self.sharded: dict[str, str] = {}  # sites and norms whose value was a DTensor (left out): name -> placements
        self.device: torch.device | None = None
        self.collector: torch.Tensor | None = None
        self.first_calls: torch.Tensor | None = None  # the collector's slots of first calls (Capture.traced_slot)
        self.fwd: torch.Tensor | None = None  # (n_slots, width): [±order (negative: not tapped), value, misfit, user...]
        self._no_grads: torch.Tensor | None = None  # the collector's gradient of a backward that gave it none: zeros
        self._indices: list[tuple[list[int], torch.Tensor] | None] = [None, None]  # (slots, on the device): Capture._index
        self.cosine = CosineRows(layout)  # sampled stack-output rows for ``cosine``
        self.snapshots: list[Snapshot] = []
        self.eager = EagerGrads(self.snapshot, lambda: self.on, self.n_taps,  # eager gradient norms (node hooks, Taps' norms)
                                lambda slot: f"site {self.sites[slot // self.K].name!r}")
        self._traced, self._eager_writer = TracedWriter(self), EagerWriter(self, self.n_slots)
        plan = plan_sites(model, layout)  # how each site is read (recorder/capture/site_plan.py)
        self._norm_kind, self._norm_in, self._taps = plan.norm_kind, plan.norm_in, plan.taps
        self._alone = [NormAlone(n.module) if k in ("fit", "rms", "scale") else None for n, k in zip(layout.norms, plan.norm_kind)]
        # norms whose gradient through them alone is a closed form that bf16/fp16 tensors spoil (no rows then)
        self.closed_form = frozenset(n.name for n, k in zip(layout.norms, plan.norm_kind) if k in ("bn", "gn"))
        self.hooked, self.alias, self.promised, self._quick = plan.hooked, plan.alias, plan.promised, plan.quick
        self.grad_expected = plan.grad_expected  # whether a site's gradient arrives: its order mark's sign
        self._planned_under: type | None = None  # the root's class when ``begin`` last checked the plan
        self._quick_now = False  # this step takes no per-site user statistics and no cosine samples
        self.sites_hooked = True  # the sites and norms are hooked (install: only if a quantity reads them)
        self.grads_moved: bool | None = None  # unhooked: whether a parameter's gradient changed in the step
        self._grads_seen: GradsSeen | None = None  # unhooked: the gradients when the step began
        self.hooks = HookSet(armed=False, root=model)  # armed only while a step records (recorder/capture/hookset.py)
        self.signals = Signals(model, layout, lambda: self.on)  # attention, sub-layer RMS and output-logit signals
        self.routers: RouterCapture | None = None  # MoE routing statistics (made by install when asked for)

    # -- installation -------------------------------------------------------------------
    def install(self, captures: frozenset[str] = frozenset()) -> None:
        """Registers every hook (once per Recorder); ``captures``: what the Recorder's
        quantities may capture (the forward signals' hooks are installed only if asked for)."""
        # sites and norms hooked only for a quantity reading them (parameter gradients alone, as Lightning's
        # grad_norm, leave the modules unhooked); an nn.LayerNorm's own hook only for w/σ (its sites hold the rest)
        self.sites_hooked = bool(SITE_CAPTURES & captures or self.value_stats or self.grad_stats)
        norms = [(j, n, k) for j, (n, k) in enumerate(zip(self.layout.norms, self._norm_kind))
                 if k not in (None, "ln") or "wsig" in captures]
        sites = [(p, self._site_flags(i)) for i, p in enumerate(self.sites)] if self.sites_hooked else []
        install_site_hooks(self.hooks, self.key, self.model, norms=norms if self.sites_hooked else [], sites=sites)
        self.signals.install(self.hooks, attention="attention" in captures, rms="rms" in captures, logits="logits" in captures)
        if "router" in captures:
            self.routers = RouterCapture(self.model, lambda: self.on)
            self.routers.install(self.hooks)
        self.hooks.run_eagerly_as_frames_of_their_own()

    def discard(self) -> None:
        """Disarms the hooks and drops what the open step captured so far."""
        self.on = False
        self.hooks.disarm()
        self.snapshots.clear()
        self._eager_writer.clear()
        self.eager.reset_backward()
        self.eager.forget()

    def dropped(self) -> None:
        """Its Recorder was collected without ``close()``: the hooks are disarmed (an open step's
        too; what the step kept, as retained aliases holding its graph, goes) and read no more."""
        self.discard()
        forget(self.key)

    def remove(self) -> None:
        """Removes every hook and lets the buffers go."""
        self.discard()
        self.hooks.remove()
        self.signals.remove()
        if self.routers is not None:
            self.routers.remove()
        self.collector = self.first_calls = self.fwd = self._no_grads = None
        forget(self.key)

    # -- per recorded step ----------------------------------------------------------------
    def begin(self, device: torch.device, captures: set[str] | frozenset[str], *, cosine_tokens: int,
              generator: torch.Generator, stats: bool = False) -> None:
        """Arms the hooks for one recorded step: ``captures`` names what the step's quantities
        capture (:data:`gradscope.recorder.quantities.quantity.CAPTURES`); ``stats``: take the user
        statistics."""
        value, grad, wsig, cosine, attention, rms, logits = (c in captures for c in (
            "value", "grad", "wsig", "cosine", "attention", "rms", "logits"))
        if self.device != device or self.collector is None:
            self.device = device
            self.collector = torch.zeros(self.n_collector, device=device, requires_grad=True)
            # (its hook runs once per backward, eager taps or not; it holds this Capture weakly: a strong reference
            # from autograd's C++ back to the owner is a cycle no collection finds, leaving a dropped Recorder armed)
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
        self._eager_writer.new_marks()
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
        self._grads_seen = None if self.sites_hooked else grads_seen(self.groups.params)  # (end compares)
        self.eager.begin()
        if attention or rms or logits:
            self.signals.begin(device, attention=attention, rms=rms, logits=logits)
        if "router" in captures and self.routers is not None:
            self.routers.begin(device)
        self.hooks.arm()
        self.on = True

    def end(self) -> tuple[list[Snapshot], list[int]]:
        """Disarms the hooks; returns the step's snapshots (‖grad‖² per tap, forward buffer, host marks,
        which gradients arrived; one per backward, a last one for forward work after it) and the call counts."""
        if self.eager.ungathered():  # a backward whose end no hook saw: its gradients are its own micro-step
            self.snapshot()
        self.on = False
        self.hooks.disarm(self.eager.handles)
        self.signals.end()
        if self.routers is not None:
            self.routers.end()
        if not (self.snapshots and self._idle_since_snapshot()):  # (an empty last snapshot adds nothing: not taken)
            self.snapshot(backward=False)
        snapshots, self.snapshots = self.snapshots, []
        if not self.sites_hooked:  # no site sees a backward: a parameter's gradient that changed tells one ran
            self.grads_moved = self._grads_seen.changed()
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
        # which gradients arrived (on the host, arrays only when rows are built: host_marks): eagerly, the
        # slots handed over; a compiled backward (the collector's gradient) materialises zeros for sites it
        # did not reach and cannot tell them, so it marks every slot REACHED_IF_TAPPED
        every = 0 if grads is None else REACHED_IF_TAPPED
        if grads is None:  # (eagerly, always: one zero vector serves, as nothing writes into it)
            grads = self._no_grads
        self.collector.grad = None
        arrived, sq = self.eager.take()
        slots, sq = joined(arrived, sq, self.eager.pending)
        if slots:
            grads = grads.index_add(0, self._index(slots, 0), sq.to(self.device))
        fwd, self.fwd = self.fwd, torch.zeros_like(self.fwd)  # (the next micro-step writes into a fresh buffer)
        marks = self._eager_writer.write_into(fwd, self._index)
        self.snapshots.append(Snapshot(grads, fwd, marks, Arrivals(every, list(arrived))))
        self.eager.reset_backward()
        self._at_snapshot = (self.calls, sum(self.calls.values()))

    def _idle_since_snapshot(self) -> bool:
        """Whether no hook counted a call since the last snapshot (the call counters are the same dict
        with the same total: a forward starts a new one, every site or norm call counts one, traced or
        eager) and no gradient came (the collector's, or an eager one; the caller has read the retained
        aliases' first): a snapshot now would hold zeros and no marks, which ``micro_steps`` drops."""
        seen, total = self._at_snapshot
        return (self.calls is seen and sum(self.calls.values()) == total and self.collector.grad is None
                and not (self._eager_writer.holds_values() or self.eager.pending))

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

        A first call writes into :attr:`first_calls` (the view ``collector[::K]``) at position
        ``site``, a later call of a shared module into the collector: the same values, but Inductor
        fuses the taps' padded gradients into one kernel visiting every tap per element, 150 × 150
        selects over the view at d=16 instead of 2400 × 150 (0.11 ms a backward) over the collector."""
        if slot % self.K:
            return self.collector, slot
        return self.first_calls, slot // self.K

    def writer(self) -> EagerWriter | TracedWriter:
        """How the calling hook writes: traced by Dynamo, or eagerly (asked once per hook call)."""
        if torch.compiler.is_compiling():
            return self._traced
        return self._eager_writer

    # -- hooks ----------------------------------------------------------------------------
    def root_forward(self, module, args, kwargs):
        """The root module's pre-hook: a forward begins (call counts start again)."""
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
        self._eager_writer.passed_on(t, out)
        return out

    def left_out_sharded(self, i: int, t: torch.Tensor) -> None:
        """Site (or norm, ``i`` past the sites) ``i`` passed on a DTensor (sequence parallelism): left out."""
        name = self.sites[i].name if i < len(self.sites) else self.layout.norms[i - len(self.sites)].name
        self.sharded.setdefault(name, str(tuple(t.placements)))

    def observe(self, i: int, t: torch.Tensor, module_args: tuple, flags: int) -> torch.Tensor | None:
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
                channel = FIRST_USER
                for f, n in zip(self.value_stats, self.value_sizes):
                    v = statistic(f, t.detach(), f"site {self.sites[i].name!r}", size=n)
                    for j in range(n):
                        w.put(slot, channel + j, v if n == 1 else v[j])
                    channel += n
            if self.want_cosine and c == 0:
                self.cosine.sample(self.sites[i].name, t)
        if not (grad and flags & TAPPED):
            return None
        return w.tap(i, t, slot, recompute, module_args)

    def _observe_eagerly(self, i: int, t: torch.Tensor, flags: int) -> torch.Tensor | None:
        """:meth:`observe` of a :attr:`_quick` site, eagerly, outside a recompute, in a step
        without user statistics or cosine samples: the :class:`EagerWriter`'s work in one frame."""
        calls, K = self.calls, self.K
        c = calls.get(i, 0)
        calls[i] = c + 1
        slot = i * K + (c if c < K else K - 1)
        grad = self.want_grad and t.requires_grad and torch.is_grad_enabled()
        self.seq = seq = self.seq + 1
        w = self._eager_writer
        w.marks[slot] = seq if grad and flags & GRAD_EXPECTED else -seq
        waits = self.want_value and w.values.add(slot, t)  # (a short value waits: no reduction of it to pass on)
        if not (grad and flags & TAPPED):
            return None
        out = t[...]  # the alias whose kept gradient is the site's (EagerWriter.tap)
        self.eager.retain(out, slot, False)
        if not waits:
            w.values.passed_on(t, out)  # (value_sq serves only models without the promise)
        return out

    def observe_norm(self, module, args, kwargs, output, j: int, kind: str | None):
        """Statistics of one call of norm ``j`` (of kind ``kind``: norm_stats.norm_kind) from its
        input and output; returns the output with its input's gradient tapped, or None."""
        counter, point = len(self.sites) + j, self._norm_in[j]
        found, y = main_input(args, kwargs), first_tensor(output)
        if found is None or y is None or found[1].is_nested or y.is_nested or found[1].shape != y.shape:
            return None  # (a nested tensor, nn.TransformerEncoder's fast path: no per-token rows to read a norm from)
        (where, x), w = found, self.writer()
        c, recompute = w.call(counter)
        grad = (kind not in (None, "ln") and point is not None and self.want_grad and y.requires_grad
                and torch.is_grad_enabled())
        wsig = self.want_wsig and not recompute
        # a closed form read from bf16/fp16 tensors is not exact (up to 5e-3 off); w/σ of a norm of unknown form is fitted
        exact = x.dtype in (torch.float32, torch.float64) and y.dtype in (torch.float32, torch.float64)
        alone = grad and (kind == "fit" or (kind in ("rms", "scale") and (not exact or not w.traced)))  # norm_alone.py
        fit = fit_norm(module, x, y) if kind == "fit" and wsig and exact else None
        slot = self.n_taps + j * self.K + c
        if fit is not None and not recompute:
            w.put(slot, MISFIT, fit.misfit)
        elif not exact and kind not in (None, "ln") and (wsig or grad and not alone) and not recompute:
            w.put(slot, MISFIT, x.new_full((), LOW_PRECISION, dtype=torch.float32))
        if wsig:
            value = w_over_sigma(module, x, y, fit)
            if value is not None:
                w.mark(slot, 1.0)
                w.put(slot, VALUE, value)
        if alone:
            run = self._alone[j]
            tapped = w.alone_tap(y, x, point * self.K + c, lambda x_in: run.run(args, kwargs, where, x_in), j)
            return None if tapped is None else replace_first(output, tapped)
        gain = norm_gain(module, kind, x, fit) if grad else None
        if gain is None:
            return None
        gain_w, is_ln, eps, dims = gain
        tapped = w.norm_tap(y, x, point * self.K + c, kind, gain_w, is_ln, eps, dims)
        return replace_first(output, tapped)

    def _site_flags(self, i: int) -> int:
        return (TAPPED if self._taps[i] else 0) | (GRAD_EXPECTED if self.grad_expected[i] else 0)


def _collector_filled(capture: weakref.ref, collector: torch.Tensor) -> None:
    """The collector's gradient arrived (a backward ended): the capture, if it is still
    there, takes a snapshot."""
    cap = capture()
    if cap is not None and collector.grad is not None:
        cap.snapshot()
