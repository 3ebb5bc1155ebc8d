"""Module hooks that are present only while a step records.

A module with any forward hook takes ``nn.Module``'s slower call path (≈1.2 µs more per
call on the project's CPU); with ~180
hooked modules that is ≈0.2 ms on every step, recorded or not. So the Recorder's hooks are
*armed* when a recorded step begins and *disarmed* when it ends, and an unrecorded step
runs the model exactly as without a Recorder.

Registering and removing 180 hooks through the public API costs ≈0.6 ms (a
``RemovableHandle`` each); re-inserting the same function under the same handle id into
the module's hook dict costs ≈0.05 µs. :class:`HookSet` registers every hook once with
the public API (so ``close()`` removes them with their handles, armed or not) and then only
moves the entries in and out of the dicts those handles point at.

A compiled model is armed and disarmed the same way. With Dynamo's hook guards on (as
they are while a Recorder is open: ``recorder/wrappers.py``), the armed and the disarmed
model each get a graph of their own, compiled once: an unrecorded step runs the graph of
the model without hooks, guarded as a plain model's is (+0.66 → +0.26 ms a step at d=16,
``benchmarks/RESULTS.md``), and a recorded step the graph with the hooks.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.utils.hooks import RemovableHandle


class HookSet:
    """Forward hooks and pre-hooks (with kwargs) that can be armed and disarmed cheaply."""

    def __init__(self, armed: bool = True) -> None:
        self._handles: list[RemovableHandle] = []
        self._entries: list[tuple[dict, dict, int, Callable]] = []  # (hooks dict, with_kwargs dict, id, hook)
        self.armed = armed

    def forward(self, module: nn.Module, hook: Callable) -> None:
        """``module.register_forward_hook(hook, with_kwargs=True)``, armed or not with the set."""
        self._add(module.register_forward_hook(hook, with_kwargs=True), module._forward_hooks,
                  module._forward_hooks_with_kwargs, hook)

    def forward_pre(self, module: nn.Module, hook: Callable) -> None:
        """``module.register_forward_pre_hook(hook, with_kwargs=True)``, armed or not with the set."""
        self._add(module.register_forward_pre_hook(hook, with_kwargs=True), module._forward_pre_hooks,
                  module._forward_pre_hooks_with_kwargs, hook)

    def _add(self, handle: RemovableHandle, hooks: dict, with_kwargs: dict, hook: Callable) -> None:
        self._handles.append(handle)
        self._entries.append((hooks, with_kwargs, handle.id, hook))
        if not self.armed:
            del hooks[handle.id], with_kwargs[handle.id]

    def arm(self) -> None:
        """Puts every hook back where it was: before the hooks registered after it (handle
        ids grow with registration), so a user's hook added later still sees our output."""
        if self.armed:
            return
        for hooks, with_kwargs, i, hook in self._entries:
            with_kwargs[i] = True
            if hooks and next(reversed(hooks)) > i:  # a later hook is there: keep the registration order
                later = [(k, hooks.pop(k)) for k in [k for k in hooks if k > i]]
                hooks[i] = hook
                hooks.update(later)
            else:
                hooks[i] = hook
        self.armed = True

    def disarm(self) -> None:
        """Takes every hook out of its module; ``arm`` puts them back."""
        if not self.armed:
            return
        for hooks, with_kwargs, i, _ in self._entries:
            hooks.pop(i, None)
            with_kwargs.pop(i, None)
        self.armed = False

    def remove(self) -> None:
        """Removes every hook for good (through its handle)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._entries.clear()
