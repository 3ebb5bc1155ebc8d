"""Activation-gradient norms when the model runs eagerly (not traced by Dynamo).

Traced, every tap is a :class:`~gradscope.recorder.capture.taps.Tap` whose backward writes ‖grad‖²
into the collector's gradient, inside the graph. Eagerly, the same numbers are taken more
cheaply:

- a module's output that the module made itself (no input passed through, no leaf, no
  view) gets a pre-hook on the autograd node that made it (no autograd node of ours and no
  Python backward node). Every use of that tensor is downstream of the
  site; a node pre-hook runs after every tensor hook on it, so it sees the gradient that
  flows on, as a Tap would; a later in-place op gives the tensor a new node, so the hook
  still sees the gradient of the value at the site;
- an output that is one of the module's inputs (an identity :class:`~gradscope.Site`), a
  leaf or a view keeps the Tap, unless the model promises that no Site output is modified
  in place (``site_outputs_never_modified_in_place``, as the zoo does): then the output is
  replaced by an alias (``aten.alias``, a C++ node that hands the gradient on unchanged)
  and the alias's node is hooked. An in-place op on such an alias would move its history
  off that node, which is why the promise is needed;
- the input of a norm that only the norm reads (a zoo SiteNorm's ``in``, or what a plain
  ``nn.LayerNorm`` receives, whose forward modifies nothing in place) is handed on as an
  alias too, whose node then sees the gradient through that norm alone;
- other module inputs keep the Tap, whose gradient is the one through that module alone
  (the residual path is not counted), and hand ‖grad‖² over here;
- a gradient that backward hands to two sites in a row (a layer's output is the next
  layer's input) is normed once;
- a short alias (fewer than ``DENSE_MIN`` elements: the host-bound case) is not hooked but
  keeps its gradient (``retain_grad``, a C++ hook, so no Python runs for it in backward);
  the end of each backward reads every kept gradient at once and lets it go, so a later
  backward through the same alias brings its own. The reading is queued by one node hook
  per forward pass, on its first alias (where backward ends); gradients of a backward that
  stopped before it are read when the step ends (:meth:`EagerGrads.retain`). Registering
  and firing a Python node hook costs ≈ 6 µs a site each way on the project's CPU.

The gradients wait in a :class:`~gradscope.recorder.numerics.squared_norms.NormBatch` until the end of
that backward, when they are reduced a stack at a time and the capture gathers the squared
norms in one ``index_add`` (one snapshot per micro-step).
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable
from functools import partial

import torch

from gradscope.recorder.capture.taps import statistic
from gradscope.recorder.numerics.squared_norms import DENSE_MIN, NormBatch


def node_hook_reads(t: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether a module's output ``t`` can be read by a hook on the node that made it: the
    module made it (it is none of its inputs, so every use of ``t`` is downstream of the
    site), it is no leaf, and no view (an in-place op on a view moves its history off that
    node). Otherwise the Tap, or an alias when the model promises no in-place op after a site."""
    if t.grad_fn is None or t._is_view():
        return False
    return not any(a is t for a in args) and not any(v is t for v in kwargs.values())


class EagerGrads:
    """The eager side of gradient capture for one :class:`~gradscope.recorder.capture.capture.Capture`.

    Args:
        on_backward_end: called once at the end of each backward that delivered a norm.
        is_on: whether a recorded step is open.
        taps: the collector's slots per channel (user statistic k goes to ``slot + k·taps``).
    """

    def __init__(self, on_backward_end: Callable[[], None], is_on: Callable[[], bool], taps: int = 0,
                 site_of: Callable[[int], str] = lambda slot: "a site") -> None:
        self._is_on = is_on
        self._site_of = site_of  # slot -> "site 'name'", for a user statistic's error
        self._taps = taps
        self.stats: tuple = ()  # the wanted quantities' ``site_grad`` in this step
        self.pending: list[tuple[int, torch.Tensor]] = []  # (slot, 0-d value) of the user statistics
        self.grads = NormBatch()  # the gradients whose ‖grad‖² the slots want (reduced together)
        self._on_backward_end = on_backward_end
        self._queued = False
        self._epoch = 0  # counts recorded steps: a hook left on a tensor of an earlier step stays silent
        self._hooked: dict[int, weakref.ref] = {}  # slot -> the tensor its node hook was put for
        self._retained: list[torch.Tensor] = []  # this step's aliases that keep their gradient (retain)
        self._retained_slots: list[int] = []
        self._last_retained = 1 << 62  # slot of the last alias retained: a lower one starts a new pass
        self.handles = 0  # node hooks registered in this step (each takes a RemovableHandle id: HookSet.disarm)

    def begin(self) -> None:
        """A new recorded step."""
        self._epoch += 1
        self.handles = 0
        self._hooked.clear()
        self.forget()
        self.pending.clear()
        self.grads.clear()

    def reset_backward(self) -> None:
        """Forgets the norms taken (after the capture gathered them)."""
        self._queued = False
        self.pending.clear()
        self.grads.clear()

    def retain(self, t: torch.Tensor, slot: int, recompute: bool) -> None:
        """Like :meth:`hook`, for an alias of ours that nothing modifies in place (a promising
        model's site output, a fused norm's input). A short one (the host-bound case) keeps
        its gradient by ``retain_grad`` (a C++ hook: no Python runs for it in backward), and
        the end of each backward reads every kept gradient at once (:meth:`take`). One node
        hook, on the first such alias of each forward pass (where backward ends), queues
        that reading; gradients no such hook saw are read when the step ends."""
        if recompute or t.numel() >= DENSE_MIN:
            self.hook(t, slot, recompute)
            return
        t.retain_grad()
        if slot <= self._last_retained:  # a new forward pass (or a shared module's next call)
            # (the hook holds this object weakly: it kept the alias, whose node keeps the hook
            # from C++, a cycle no collection finds if the step never ends: a Recorder dropped)
            t.grad_fn.register_prehook(partial(_wake, weakref.ref(self), self._epoch))
            self.handles += 1
        self._last_retained = slot
        self._retained_slots.append(slot)
        self._retained.append(t)

    def wake(self, epoch: int) -> None:
        """Backward reached the first retained alias of a forward pass: the kept gradients are
        read when it ends."""
        if not self._queued and epoch == self._epoch and self._is_on():
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def take(self) -> tuple[list[int], torch.Tensor | None]:
        """(slots, fp32 ‖grad‖²) of the gradients this backward delivered: those node hooks
        and Taps handed over, and those the retained aliases kept (read, then let go, so a
        later backward through them brings its own)."""
        if self._retained:
            grads = list(map(_grad, self._retained))
            if any(map(operator.is_, grads, itertools.repeat(None))):  # (not `in`: that compares tensors)
                got = [k for k, g in enumerate(grads) if g is not None]
                slots, tensors, grads = ([self._retained_slots[k] for k in got], [self._retained[k] for k in got],
                                         [grads[k] for k in got])
            else:
                slots, tensors = self._retained_slots, self._retained
            if grads:
                list(map(setattr, tensors, itertools.repeat("grad"), itertools.repeat(None)))
                self.grads.add_many(slots, grads, short=True)  # (retained: short, strided)
                if self.stats:
                    self.pending += [(slot + (k + 1) * self._taps, statistic(f, g, partial(self._site_of, slot)))
                                     for slot, g in zip(slots, grads) for k, f in enumerate(self.stats)]
        return self.grads.take()

    def ungathered(self) -> bool:
        """Whether a retained alias holds a gradient no backward's end has read (a backward
        that did not pass the first alias of a forward pass, where the reading is queued)."""
        return any(map(operator.is_not, map(_grad, self._retained), itertools.repeat(None)))  # (C-level passes: 150 aliases in 5 µs)

    def forget(self) -> None:
        """Lets the retained aliases of the step go."""
        self._retained, self._retained_slots = [], []
        self._last_retained = 1 << 62

    def hook(self, t: torch.Tensor, slot: int, recompute: bool) -> None:
        """Takes ‖∂loss/∂t‖² into ``slot`` when backward reaches the node that made ``t``
        (``t``: a non-leaf tensor the module made itself, or an alias; see :func:`node_hook_reads`)."""
        if recompute:  # non-reentrant checkpointing hands the forward's own tensor over again
            seen = self._hooked.get(slot)
            if seen is not None and seen() is t:
                return
        else:
            self._hooked[slot] = weakref.ref(t)
        t.grad_fn.register_prehook(partial(self._node_hook, slot, self._epoch, t.output_nr))
        self.handles += 1

    def _node_hook(self, slot: int, epoch: int, output: int, grads: tuple) -> None:
        grad = grads[output]
        if grad is None or epoch != self._epoch or not self._is_on():  # (live(), inlined: once per site)
            return
        if self._queued and not self.stats:
            self.grads.add(slot, grad)
        else:
            self.add(slot, grad)

    @property
    def epoch(self) -> int:
        """The recorded step's number (a hook or Tap keeps the one it was made in)."""
        return self._epoch

    def live(self, epoch: int) -> bool:
        """Whether a hook or Tap made in ``epoch`` may report: not one on a graph kept from an
        earlier step (``retain_graph=True``) that backward runs through again."""
        return epoch == self._epoch and self._is_on()

    def add(self, slot: int, grad: torch.Tensor) -> None:
        """``grad`` for ``slot``: its ‖grad‖² (and user statistics); the end of this backward
        hands them to the capture."""
        self.grads.add(slot, grad)
        if self.stats:
            where = partial(self._site_of, slot)
            self.pending += [(slot + (k + 1) * self._taps, statistic(f, grad, where)) for k, f in enumerate(self.stats)]
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)


def _wake(grads_ref: weakref.ref, epoch: int, grads: tuple) -> None:
    eager = grads_ref()
    if eager is not None:
        eager.wake(epoch)


_grad = operator.attrgetter("grad")


def joined(slots: list[int], sq: torch.Tensor | None, pending: list[tuple[int, torch.Tensor]]
            ) -> tuple[list[int], torch.Tensor | None]:
    """A batch's (slots, values) followed by values that came one at a time as (slot, 0-d)."""
    if not pending:
        return slots, sq
    one_by_one = torch.stack([v.float() for _, v in pending])
    values = one_by_one if sq is None else torch.cat([sq, one_by_one.to(sq.device)])
    return slots + [s for s, _ in pending], values
