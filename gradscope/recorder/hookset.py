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

**Compiled models.** Dynamo does not guard a module's *empty* hook dicts
(``torch._dynamo.config.skip_nnmodule_hook_guards``, on by default): a graph traced from a
module without hooks would run for it with hooks, and for another instance of its class
that has them. Turning those guards on costs every compiled model in the process ≈1.2 ms
a step at d=16 (2600 guards on the hook dicts of every module; ``benchmarks/RESULTS.md``).
Instead, an armed module's class is swapped for an *armed twin* (:func:`armed_class`): a
subclass that adds nothing, with the same name and module, one per class and process, in
the way ``torch.distributed.fsdp.fully_shard`` swaps a module's class. Dynamo guards every
module's type, so a graph traced without the hooks never runs for an armed module and one
traced with them never for an unarmed one (a plain twin, or the same model between recorded
steps, which then runs the graph a plain model would, with a plain model's guards).
Disarming puts the original class back; so does ``remove()``.
"""

from __future__ import annotations

import copyreg
import weakref
from collections.abc import Callable

from torch import nn
from torch.utils.hooks import RemovableHandle


class HookSet:
    """Forward hooks and pre-hooks (with kwargs) that can be armed and disarmed cheaply."""

    def __init__(self, armed: bool = True) -> None:
        self._handles: list[RemovableHandle] = []
        self._entries: list[tuple[dict, dict, int, Callable]] = []  # (hooks dict, with_kwargs dict, id, hook)
        self.armed = armed
        self._modules: list[nn.Module] = []  # the hooked modules, once each (their class is swapped while armed)
        self._refs: list[weakref.ref] = []  # a weak reference to each, made once (arming counts by it)
        self._module_ids: set[int] = set()

    def forward(self, module: nn.Module, hook: Callable) -> None:
        """``module.register_forward_hook(hook, with_kwargs=True)``, armed or not with the set."""
        self._add(module, module.register_forward_hook(hook, with_kwargs=True), module._forward_hooks,
                  module._forward_hooks_with_kwargs, hook)

    def forward_pre(self, module: nn.Module, hook: Callable) -> None:
        """``module.register_forward_pre_hook(hook, with_kwargs=True)``, armed or not with the set."""
        self._add(module, module.register_forward_pre_hook(hook, with_kwargs=True), module._forward_pre_hooks,
                  module._forward_pre_hooks_with_kwargs, hook)

    def _add(self, module: nn.Module, handle: RemovableHandle, hooks: dict, with_kwargs: dict, hook: Callable) -> None:
        if id(module) not in self._module_ids:
            self._module_ids.add(id(module))
            self._modules.append(module)
            self._refs.append(weakref.ref(module))
            if self.armed:
                _arm_classes([module], self._refs[-1:])
        self._handles.append(handle)
        _OURS.add(handle.id)
        self._entries.append((hooks, with_kwargs, handle.id, hook))
        if not self.armed:
            del hooks[handle.id], with_kwargs[handle.id]

    @property
    def modules(self) -> list[nn.Module]:
        """The hooked modules, once each."""
        return self._modules

    def functions(self) -> list[Callable]:
        """The hook functions, in registration order."""
        return [hook for *_, hook in self._entries]

    def run_eagerly_as_frames_of_their_own(self) -> None:
        """Dynamo runs the hook functions eagerly where it meets them as frames of their own.

        The hooks of a module that ``torch.compile`` wraps (the model, or each block compiled
        on its own, torchtitan-style) run outside its compiled forward, and Dynamo meets them
        as frames of their own. Compiled alone, such a frame specialises on the capture's call
        counters and recompiles for every block, past Dynamo's recompile limit (8) at 12
        blocks; run eagerly, it is one eager hook. Hooks that Dynamo inlines into a traced
        forward (every other module's) are traced as before: Dynamo's frame strategy marks
        the frame and the frames it calls (``torch._dynamo.eval_frame.skip_code`` does the
        first only), not the function, which ``torch.compiler.disable`` would make a graph
        break wherever it is traced."""
        try:
            from torch._dynamo.eval_frame import set_code_exec_strategy
            from torch._dynamo.types import FrameAction, FrameExecStrategy
        except ImportError:  # (a torch without frame strategies: Dynamo compiles them as before)
            return
        for code in {getattr(h, "__func__", h).__code__ for h in self.functions()}:
            set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))

    def arm(self) -> None:
        """Puts every hook back where it was: before the hooks registered after it (handle
        ids grow with registration), so a user's hook added later still sees our output;
        gives each hooked module its armed twin class."""
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
        _arm_classes(self._modules, self._refs)
        self.armed = True

    def disarm(self) -> None:
        """Takes every hook out of its module and gives it its own class back (unless
        something gave it another class since); ``arm`` puts them back."""
        if not self.armed:
            return
        for hooks, with_kwargs, i, _ in self._entries:
            hooks.pop(i, None)
            with_kwargs.pop(i, None)
        _disarm_classes(self._modules, self._refs)
        self.armed = False

    def remove(self) -> None:
        """Removes every hook for good (through its handle); every module has its own class."""
        self.disarm()
        self._modules.clear()
        self._refs.clear()
        self._module_ids.clear()
        for h in self._handles:
            _OURS.discard(h.id)
            h.remove()
        self._handles.clear()
        self._entries.clear()


_SET_CLASS = object.__setattr__  # (not nn.Module.__setattr__, which looks through the module's dicts first)
_ARMED: dict[type, type] = {}  # a module class -> its armed twin
_ORIGINAL: dict[type, type] = {}  # an armed twin -> the class it stands for
_ARMS: dict[int, tuple[weakref.ref, int]] = {}  # id(module) -> (module, how many armed HookSets hold it)


def _arm_classes(modules: list[nn.Module], refs: list[weakref.ref]) -> None:
    """Gives each module its armed twin class and counts one more armed HookSet holding it
    (``refs``: a weak reference to each module, which the count keeps, so that an id left by
    a module collected while armed is not taken for a later module's)."""
    for m, ref in zip(modules, refs):
        held = _ARMS.get(id(m))
        count = held[1] if held is not None and (held[0] is ref or held[0]() is m) else 0
        _ARMS[id(m)] = (ref, count + 1)
        cls = type(m)
        _SET_CLASS(m, "__class__", cls if cls in _ORIGINAL else _ARMED.get(cls) or armed_class(cls))


def _disarm_classes(modules: list[nn.Module], refs: list[weakref.ref]) -> None:
    """Each module's own class back once no armed HookSet holds it (and if nothing else gave
    it another class meanwhile, as ``fully_shard`` would)."""
    for m, ref in zip(modules, refs):
        held = _ARMS.pop(id(m), None)
        left = held[1] - 1 if held is not None and (held[0] is ref or held[0]() is m) else 0
        if left > 0:
            _ARMS[id(m)] = (held[0], left)
            continue
        base = _ORIGINAL.get(type(m))
        if base is not None:
            _SET_CLASS(m, "__class__", base)


def armed_class(cls: type) -> type:
    """The armed twin of a module class: a subclass of ``cls`` that adds nothing (same name,
    qualified name and module; ``isinstance(m, cls)`` still holds), one per
    class and process, so that Dynamo's type guard tells an armed module from an unarmed
    instance of ``cls``. Copied or pickled while armed, a module is one of ``cls`` without the
    recorder's hooks (:func:`_reduce_as_original`). A twin is its own twin."""
    if cls in _ORIGINAL:
        return cls
    twin = _ARMED.get(cls)
    if twin is None:
        twin = _ARMED[cls] = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                         "__reduce_ex__": _reduce_as_original})
        _ORIGINAL[twin] = cls
    return twin


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")
_OURS: set[int] = set()  # handle ids of every HookSet's hooks (ids are unique in the process)


def _reduce_as_original(self, protocol):
    """``copy.deepcopy`` or pickle of an armed module (during a recorded step): an instance
    of its own class, without the recorder's hooks, as it would be between steps."""
    state = dict(self.__getstate__())
    for name in _HOOK_DICTS:
        hooks = state.get(name)
        if hooks and any(k in _OURS for k in hooks):
            state[name] = type(hooks)((k, v) for k, v in hooks.items() if k not in _OURS)
    # (copyreg's __newobj__ would have pickle check that the class is the object's own)
    return copyreg._reconstructor, (_ORIGINAL[type(self)], object, None), state
