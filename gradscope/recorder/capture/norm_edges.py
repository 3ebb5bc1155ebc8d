"""The gradient through a norm alone, read eagerly on the autograd edges from the norm into its input.

Run eagerly, a norm's call leaves its own autograd nodes between its output ``y`` and its
input ``x``; the gradients those nodes send along their edges into ``x``'s node are, summed,
the gradient through the norm alone (autograd adds the residual branch's gradient to them
only in ``x``'s node). A post-hook on each such node reads the entries of its ``grad_inputs``
that go to ``x`` and sums them on the side: the hook changes nothing autograd computes (it
returns None and keeps nothing past the backward), so training is bit-identical, for any
norm's form, gain or eps, and nothing is run again. The norm's own nodes are those made
during its call: their sequence numbers are at least the one the norm's pre-hook read when
the call began (:func:`sequence_number`); the walk stops at every older node and at the
parameters' ``AccumulateGrad``.

Where no such edge is found (a norm whose output is its input, an input that takes no
gradient, a norm that changes its input in place), nothing is hooked and the norm
is run again alone (:mod:`gradscope.recorder.capture.norm_alone`), as it is when traced by
Dynamo, where no node exists to be hooked.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
from torch.autograd.graph import get_gradient_edge

sequence_number = torch._C._autograd._get_sequence_nr  # the number the next autograd node made on this thread gets

_MAX_NODES = 64  # a norm's own subgraph is a handful of nodes; a longer walk is not a norm's (then run again alone)


def edges_into(y: torch.Tensor, x: torch.Tensor, start: int) -> list[tuple[object, tuple[int, ...]]] | None:
    """The autograd nodes made since ``start`` between ``y`` and ``x`` that send a gradient
    to ``x``, each with the positions in its ``next_functions`` that point at ``x``; None if
    there is none, or if the walk passes more than ``_MAX_NODES`` nodes."""
    if not x.requires_grad or y.grad_fn is None or y.grad_fn._sequence_nr() < start:
        return None
    target, output_nr = x.grad_fn, x.output_nr
    if target is None:  # a leaf: its edges go to its AccumulateGrad
        edge = get_gradient_edge(x)
        target, output_nr = edge.node, edge.output_nr
    root = y.grad_fn
    if root is target:
        return None
    seen, stack, found = {root}, [root], []
    while stack:
        node = stack.pop()
        into = []
        for i, (nxt, nr) in enumerate(node.next_functions):
            if nxt is target:
                if nr == output_nr:
                    into.append(i)
            elif nxt is not None and nxt not in seen and start <= nxt._sequence_nr() < _ACCUMULATE_NR:
                if len(seen) >= _MAX_NODES:
                    return None
                seen.add(nxt)
                stack.append(nxt)
        if into:
            found.append((node, tuple(into)))
    return found or None


_ACCUMULATE_NR = (1 << 64) - 1  # an AccumulateGrad node's sequence number (a leaf's: nothing to walk past)


def hook_edges(eager, y: torch.Tensor, x: torch.Tensor, start: int, slot: int) -> bool:
    """Hooks the edges from the norm's own nodes into ``x`` (made since ``start``, ending in
    ``y``) so that backward hands the gradient through the norm alone to ``eager`` (an
    :class:`~gradscope.recorder.capture.eager.EagerGrads`, held weakly: a node keeps its hook
    from C++) at ``slot``; False (nothing hooked) if no such edge is found.

    Each node's post-hook is a closure that reads its ``grad_inputs`` entries into ``x``: with
    one node (a norm that casts its input first, as in bf16) it hands them over itself; with
    several (x·rsqrt(mean(x²)) reads ``x`` twice) each adds its part to the sum so far and the
    last to run hands the sum over (a second backward through a kept graph sums afresh). Only
    that one asks whether the step is still live."""
    found = edges_into(y, x, start)
    if found is None:
        return False
    deliver = partial(_deliver, weakref.ref(eager), eager.epoch, slot)
    if len(found) == 1 and len(found[0][1]) == 1:
        node, (i,) = found[0]
        node.register_hook(partial(_single, i, deliver))
    else:
        state = [0, None]  # (nodes that ran, their sum so far)
        for node, into in found:
            node.register_hook(partial(_part, into, state, len(found), deliver))
    eager.handles += len(found)
    return True


def _single(i: int, deliver, grad_inputs: tuple, grad_outputs: tuple) -> None:
    """The post-hook of a norm's only node with an edge into its input (at ``i``)."""
    g = grad_inputs[i]
    if g is not None:
        deliver(g)


def _part(into: tuple[int, ...], state: list, nodes: int, deliver, grad_inputs: tuple, grad_outputs: tuple) -> None:
    """The post-hook of one of ``nodes`` nodes with edges into the norm's input (at ``into``):
    ``state`` holds how many of them ran and the sum so far."""
    ran, total = state
    for i in into:
        g = grad_inputs[i]
        if g is not None:
            total = g if total is None else total + g
    if ran + 1 < nodes:
        state[0], state[1] = ran + 1, total
        return
    state[0], state[1] = 0, None
    if total is not None:
        deliver(total)


def _deliver(eager_ref: weakref.ref, epoch: int, slot: int, grad: torch.Tensor) -> None:
    eager = eager_ref()
    if eager is not None and eager.live(epoch):
        eager.add(slot, grad)
