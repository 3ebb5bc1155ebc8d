"""The hooks of a Capture: module-level functions, each told its site by an int *tag*.

A hook finds its Capture in the registry ``_LIVE`` by the key in its tag, so that no hook
holds a Capture (a Recorder dropped without ``close()`` is not kept alive by a hook left in
a module's dict). The tag also carries the site's flags and counter: Dynamo guards every
closure cell of a traced hook and every list item a traced hook reads, so one int, instead
of two to five cells and per-site lists, keeps ≈700 guards of 180 hooks out of a recorded
graph's guards, which every compiled call checks. Carried by a module's class
(:mod:`gradscope.recorder.capture.carrying`), the tag is a constant of its generated forward,
which calls the function directly.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from gradscope.recorder.capture.params import is_dtensor
from gradscope.recorder.capture.taps import first_tensor, main_input, replace_first
from gradscope.recorder.numerics.norm_stats import NORM_KINDS

_LIVE: dict[int, Any] = {}  # open Captures (capture/capture.py) by key; a hook finds its own here (see Capture.key)
_KEYS = itertools.count()

_SHIFT, _FLAGS = 32, 24  # a tag's bits: Capture key from 32 on, flags from 24 to 31, counter below
_MASK = (1 << _FLAGS) - 1
TAPPED, GRAD_EXPECTED = 1, 2  # a site's flags: its value is tapped for its gradient; its gradient is expected


def _tag(key: int, counter: int, flags: int = 0) -> int:
    """One int for a hook's Capture key, its site's flags and its counter."""
    if counter > _MASK:
        raise ValueError(f"a model with more than {_MASK} sites or norms cannot be recorded")
    return key << _SHIFT | flags << _FLAGS | counter


def _tagged(function, tag: int) -> tuple:
    """(hook for the hook dicts, (function, tag) for a carrying class) of one site."""

    def hook(module, *args_kwargs_output):
        return function(tag, module, *args_kwargs_output)

    return hook, (function, tag)


def _root_hook(key: int):
    """The root's pre-hook: it reads its Capture by key, so that a Recorder dropped inside
    a step is not kept alive by the hook left in the model's dict."""

    def hook(module, args, kwargs):
        cap = _LIVE.get(key)
        return None if cap is None else cap.root_forward(module, args, kwargs)

    return hook


def _output_hook(tag: int, module, args, kwargs, output):
    cap = _LIVE.get(tag >> _SHIFT)
    if cap is None or not cap.on:
        return None
    plain = type(output) is torch.Tensor  # (most sites: first_tensor and replace_first are the output itself)
    t = output if plain else first_tensor(output)
    if t is None or not t.is_floating_point():
        return None
    if not plain and type(t) is not torch.Tensor and is_dtensor(t):  # (sequence parallelism: a slice of the sequence per rank)
        return cap.left_out_sharded(tag & _MASK, t)
    new = cap.observe(tag & _MASK, t, (args, kwargs), tag >> _FLAGS & 255)
    return new if plain or new is None else replace_first(output, new)


def _input_hook(tag: int, module, args, kwargs):
    cap = _LIVE.get(tag >> _SHIFT)
    if cap is None or not cap.on:
        return None
    found = main_input(args, kwargs)
    if found is None:
        return None
    where, t = found
    if type(t) is not torch.Tensor and is_dtensor(t):
        return cap.left_out_sharded(tag & _MASK, t)
    new = cap.observe(tag & _MASK, t, ((), {}), tag >> _FLAGS & 255)
    if new is None:
        return None
    if isinstance(where, int):
        return (*args[:where], new, *args[where + 1:]), kwargs
    return args, {**kwargs, where: new}


def _norm_hook(tag: int, module, args, kwargs, output):
    cap = _LIVE.get(tag >> _SHIFT)
    if cap is None or not cap.on:
        return None
    y = first_tensor(output)
    if y is not None and type(y) is not torch.Tensor and is_dtensor(y):
        return cap.left_out_sharded(len(cap.sites) + (tag & _MASK), y)
    return cap.observe_norm(module, args, kwargs, output, tag & _MASK, NORM_KINDS[tag >> _FLAGS & 255])


def _norm_pre_hook(tag: int, module, args, kwargs):
    cap = _LIVE.get(tag >> _SHIFT)
    if cap is not None and cap.on:
        cap.writer().begin_norm(tag & _MASK)
    return None


SITE_CAPTURES = frozenset({"value", "grad", "wsig", "cosine"})  # the captures read at the sites' and norms' hooks
RUN_ALONE_KINDS = ("fit", "rms", "scale")  # norms whose gradient through them alone may be read on their edges (norm_edges.py)


def install_site_hooks(hooks, key: int, model, *, norms: list, sites: list) -> None:
    """Registers a Capture's permanent hooks in ``hooks`` (a :class:`~gradscope.recorder.capture.hookset.HookSet`):
    the root's pre-hook, each norm's forward hook (``norms``: (index, norm, kind) triples, before the
    site taps so that it sees the norm's raw output; and a pre-hook that notes when its call
    begins if it may be read on its own autograd edges), and each site's hook on its module's
    output or input (``sites``: (site, flags) pairs). ``key``: the Capture's in :data:`_LIVE`."""
    hooks.forward_pre(model, _root_hook(key))
    for j, norm, kind in norms:
        if kind in RUN_ALONE_KINDS:
            hooks.forward_pre(norm.module, *_tagged(_norm_pre_hook, _tag(key, j)))
        hooks.forward(norm.module, *_tagged(_norm_hook, _tag(key, j, NORM_KINDS.index(kind))))
    for i, (site, flags) in enumerate(sites):
        tagged = _tagged(_output_hook if site.where == "output" else _input_hook, _tag(key, i, flags))
        if site.where == "output":
            hooks.forward(site.module, *tagged)
        else:
            hooks.forward_pre(site.module, *tagged)


def forget(key: int) -> None:
    """Drops a Capture from the registry its hooks read (by ``close()``, or when its Recorder
    is collected); hooks still installed then return at once."""
    _LIVE.pop(key, None)
