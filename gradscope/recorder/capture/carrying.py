"""Hooks carried by a module's class: a generated ``forward`` that calls them around the module's own.

A module with hooks in its hook dicts takes ``nn.Module._call_impl``'s long path (≈1 µs
more per call on the project's CPU) and, traced by Dynamo, is guarded on every compiled
call by the contents of its four hook dicts, each hook's code and closure, and three
attributes its instance dict must not have: ≈20 guards a module, ≈0.7 ms a recorded
compiled step of 180 hooked modules at d=16 (``benchmarks/RESULTS.md``). A module whose
class is a *carrying class* has empty hook dicts: its class's ``forward`` calls the hooks,
``base.forward`` and the forward hooks, as ``_call_impl`` would call them from the dicts.
Dynamo then guards it by its type alone, as it guards any module's own ``forward``.

The ``forward`` is generated from source, so that each hook's *tag* (the int that tells
a shared hook function which site it serves) is a constant of its code, and each function
it calls is a global of one namespace (``_NAMESPACE``), which Dynamo guards once per graph
rather than once per module.

The Recorder carries only a module that has no other hooks (its own or global module
hooks) when its step begins, so hooks run in the order the hook dicts would give. A hook
registered *inside* a recorded step, on such a module or globally, runs around the
class's ``forward``: a pre-hook before the recorder's hooks, a forward hook after them,
also one registered with ``prepend=True`` or as a global hook (which the dicts would have
run first).
"""

from __future__ import annotations

import builtins
import itertools
from collections.abc import Callable

_NAMESPACE: dict = {"__builtins__": builtins}  # the globals of every generated forward
_NAMES: dict[int, tuple[str, int]] = {}  # id(function) -> (its name there, how many carrying classes use it)
_COUNT = itertools.count(1)


def carrying_class(base: type, pre_hooks: list[tuple[Callable, int]], forward_hooks: list[tuple[Callable, int]],
                   extra: dict | None = None) -> type:
    """A subclass of ``base`` (same name, qualified name and module, ``isinstance`` holds)
    whose ``forward`` runs the hooks around ``base.forward``.

    Args:
        base: the module's class.
        pre_hooks: ``(function, tag)`` pairs, called in order as
            ``function(tag, module, args, kwargs)``; a result other than None is the new
            ``(args, kwargs)``.
        forward_hooks: ``(function, tag)`` pairs, called in order as
            ``function(tag, module, args, kwargs, output)``; a result other than None is the
            new output.
        extra: more class attributes.

    Returns:
        The class; :func:`release` it when it is no longer used.
    """
    names = [_name_of(base.forward)]
    lines = ["def forward(self, *args, **kwargs):"]
    for function, tag in pre_hooks:
        names.append(_name_of(function))
        lines += [f"    result = {names[-1]}({int(tag)!r}, self, args, kwargs)",
                  "    if result is not None:", "        args, kwargs = result"]
    lines.append(f"    output = {names[0]}(self, *args, **kwargs)")
    for function, tag in forward_hooks:
        names.append(_name_of(function))
        lines += [f"    result = {names[-1]}({int(tag)!r}, self, args, kwargs, output)",
                  "    if result is not None:", "        output = result"]
    lines.append("    return output")
    made: dict = {}
    exec(compile("\n".join(lines), f"<gradscope: hooks carried by {base.__qualname__}.forward>", "exec"),
         _NAMESPACE, made)
    return type(base.__name__, (base,), {
        "__module__": base.__module__, "__qualname__": base.__qualname__, "forward": made["forward"],
        "_gradscope_names": tuple(names), **(extra or {})})


def is_carrying(cls: type) -> bool:
    """Whether ``cls`` is a carrying class."""
    return "_gradscope_names" in cls.__dict__


def release(cls: type) -> None:
    """A carrying class is no longer used: a function of its leaves the namespace once no
    other class uses it."""
    for name in cls.__dict__["_gradscope_names"]:
        key = id(_NAMESPACE.get(name))
        held = _NAMES.get(key)
        if held is None or held[0] != name:
            continue
        if held[1] > 1:
            _NAMES[key] = (name, held[1] - 1)
        else:
            del _NAMES[key], _NAMESPACE[name]


def _name_of(function: Callable) -> str:
    """``function``'s name in the namespace (one more class uses it)."""
    held = _NAMES.get(id(function))
    if held is None:
        held = (f"_gradscope_{next(_COUNT)}", 0)
        _NAMESPACE[held[0]] = function
    _NAMES[id(function)] = (held[0], held[1] + 1)
    return held[0]
