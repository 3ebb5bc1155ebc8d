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

**Carried hooks.** Most of a Recorder's hooks are one module-level function each with an
int *tag* (which site). While armed, a module that has only such hooks, and no hooks of
anyone else, is not given its hooks in its dicts but a *carrying class*
(:mod:`gradscope.recorder.capture.carrying`) whose ``forward`` calls them around the module's
own: the module takes the short call path, and a compiled graph is guarded by its type
alone (≈1600 guards fewer at d=16 on 180 modules). The root module and any module with
other hooks keep the hook dicts, so hooks always run in the order the dicts give them.
"""

from __future__ import annotations

import copyreg
import itertools
import weakref
from collections.abc import Callable

from torch import nn
from torch.nn.modules import module as _module
from torch.utils.hooks import RemovableHandle

from gradscope.recorder.capture.carrying import carrying_class, is_carrying, release
from gradscope.recorder.discovery.module_class import STANDS_FOR as _ORIGINAL


class HookSet:
    """Forward hooks and pre-hooks (with kwargs) that can be armed and disarmed cheaply.

    Args:
        armed: whether the hooks are in place from the start.
        root: a module whose hooks always stay in its hook dicts (the recorded model: a
            ``torch.compile`` wrapper runs them outside its compiled frame). Another module
            whose hooks are all *tagged* may have them carried by its class while armed
            (:mod:`gradscope.recorder.capture.carrying`).
    """

    def __init__(self, armed: bool = True, root: nn.Module | None = None) -> None:
        self._handles: list[RemovableHandle] = []
        self.armed = armed
        self._root = root
        self._modules: list[nn.Module] = []  # the hooked modules, once each (their class is swapped while armed)
        self._refs: list[weakref.ref] = []  # a weak reference to each, made once (arming counts by it)
        self._index: dict[int, int] = {}  # id(module) -> its place in _modules
        self._tagged: list[tuple[list, list] | None] = []  # per module: its (function, tag) pre- and forward hooks; None: not carried
        self._twins: list[type | None] = []  # per module: its carrying class, made at its first carried arming
        self._carried: list[bool] = []  # per module: carried by its class in the open arming
        self._entries: list[list[tuple[dict, dict, int, Callable]]] = []  # per module: (hooks dict, with_kwargs dict, id, hook)
        # (shared with the finalizer and the registry of armed sets: whether the set is armed,
        # and whether its modules are counted in _ARMS in the open arming)
        self._live = [armed, False]
        self._stamp = -1  # RemovableHandle.next_id when the set last armed, or disarmed with no other handle taken (see arm)
        weakref.finalize(self, _dropped, self._live, self._refs, self._twins)  # (a set dropped without remove())

    def forward(self, module: nn.Module, hook: Callable, tagged: tuple[Callable, int] | None = None) -> None:
        """``module.register_forward_hook(hook, with_kwargs=True)``, armed or not with the set.

        Args:
            module: the hooked module.
            hook: ``hook(module, args, kwargs, output)``.
            tagged: ``(function, tag)``, where the module-level ``function(tag, module, args,
                kwargs, output)`` does what ``hook`` does. Carried by the module's class, the
                tag is a constant of its ``forward``. Without it, the module keeps its hook dicts.
        """
        self._add(module, module.register_forward_hook(hook, with_kwargs=True), module._forward_hooks,
                  module._forward_hooks_with_kwargs, hook, tagged, pre=False)

    def forward_pre(self, module: nn.Module, hook: Callable, tagged: tuple[Callable, int] | None = None) -> None:
        """``module.register_forward_pre_hook(hook, with_kwargs=True)``, armed or not with the
        set; ``tagged``: as for :meth:`forward`, ``function(tag, module, args, kwargs)``."""
        self._add(module, module.register_forward_pre_hook(hook, with_kwargs=True), module._forward_pre_hooks,
                  module._forward_pre_hooks_with_kwargs, hook, tagged, pre=True)

    def _add(self, module: nn.Module, handle: RemovableHandle, hooks: dict, with_kwargs: dict, hook: Callable,
             tagged: tuple[Callable, int] | None, pre: bool) -> None:
        armed = self.armed
        self.disarm()  # (a hook registered while armed: armed again below, with it)
        k = self._index.get(id(module))
        if k is None:
            k = self._index[id(module)] = len(self._modules)
            self._modules.append(module)
            self._refs.append(weakref.ref(module))
            self._tagged.append(None if module is self._root else ([], []))
            self._twins.append(None)
            self._carried.append(False)
            self._entries.append([])
        if tagged is None:
            self._tagged[k] = None  # (a hook without a tag: the module keeps its hook dicts)
        elif self._tagged[k] is not None:
            self._tagged[k][0 if pre else 1].append(tagged)
        self._forget_twin(k)
        self._handles.append(handle)
        _OURS.add(handle.id)
        self._entries[k].append((hooks, with_kwargs, handle.id, hook))
        del hooks[handle.id], with_kwargs[handle.id]
        if armed:
            self.arm()

    @property
    def modules(self) -> list[nn.Module]:
        """The hooked modules, once each."""
        return self._modules

    def functions(self) -> list[Callable]:
        """The hook functions, module by module (each module's in registration order)."""
        return [hook for entries in self._entries for _, _, _, hook in entries]

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
        """Puts every hook in place. A module whose hooks are all tagged and that has no
        other hooks (:func:`_no_hooks`), no ``forward`` of its own instance and no
        ``Module.compile`` gets its carrying class, whose ``forward`` runs them; any other
        module gets its hooks back into its hook dicts, before the hooks registered after
        them (handle ids grow with registration), so a user's hook added later still sees
        our output, and its armed twin class.

        One pass over the modules, touching each module's state once: on a GPU the step's
        host work is the cost, and between two recorded steps these objects have left the
        CPU's caches. Modules are counted in ``_ARMS`` (:func:`_count`) only while another
        HookSet is armed too, and a module carried in the last arming has its four hook dicts
        read again only if a hook was registered anywhere since (every registration takes a
        ``RemovableHandle`` id; the node hooks of the recorded step itself are counted by
        :meth:`disarm`'s caller and do not count)."""
        if self.armed:
            return
        live = self._live
        others = [held for key, held in _ARMED_SETS.items() if key != id(live)]
        for other, refs in others:
            if not other[1]:  # (armed alone until now: its modules are counted from here on)
                _count(refs)
                other[1] = True
        quiet = not (_GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1] or _GLOBAL_HOOKS[2] or _GLOBAL_HOOKS[3])
        # No hook registered anywhere since the last arming (every registration takes a handle id):
        # a module carried then has no hook of anyone else's now, and its four hook dicts,
        # which have left the CPU's caches, are not read again
        same, self._stamp = RemovableHandle.next_id == self._stamp, RemovableHandle.next_id
        carried = self._carried
        for k, m, tagged, twin, entries in zip(itertools.count(), self._modules, self._tagged, self._twins,
                                               self._entries):
            cls = type(m)
            state = m.__dict__
            # carriable, hooks aside: no twin (another armed HookSet holds it), no ``forward`` of its own
            # instance, not compiled by ``Module.compile`` (whose hooks run outside its compiled frame);
            # (inline: one call fewer per module)
            carry = carried[k] = (quiet and tagged is not None
                                  and not (cls in _ORIGINAL or "forward" in state
                                           or state.get("_compiled_call_impl") is not None)
                                  and ((same and carried[k]) or _no_hooks(state)))
            if carry:
                _SET_CLASS(m, "__class__", twin if twin is not None and twin.__base__ is cls else self._twin(k))
                continue
            for hooks, with_kwargs, i, hook in entries:
                with_kwargs[i] = True
                if hooks and next(reversed(hooks)) > i:  # a later hook is there: keep the registration order
                    later = [(j, hooks.pop(j)) for j in [j for j in hooks if j > i]]
                    hooks[i] = hook
                    hooks.update(later)
                else:
                    hooks[i] = hook
            _SET_CLASS(m, "__class__", _with_dicts(cls))
        live[1] = bool(others)
        if others:
            _count(self._refs)
        _ARMED_SETS[id(live)] = (live, self._refs)
        self.armed = live[0] = True

    def _twin(self, k: int) -> type:
        """Module ``k``'s carrying class for its present class (made again if that changed)."""
        self._forget_twin(k)
        twin = self._twins[k] = carrying_class(type(self._modules[k]), *self._tagged[k],
                                               extra={"__reduce_ex__": _reduce_as_original})
        _ORIGINAL[twin] = twin.__base__
        return twin

    def _forget_twin(self, k: int) -> None:
        _forget_twins(self._twins, k)

    def disarm(self, own_handles: int = 0) -> None:
        """Takes every hook out of its module and gives it its own class back (unless
        something gave it another class since); ``arm`` puts them back.

        Args:
            own_handles: how many handles the caller took while armed (the eager node hooks
                of a recorded step). If no one else took one, the next arming may trust the
                modules' hook dicts as this one read them (see :meth:`arm`)."""
        if not self.armed:
            return
        if RemovableHandle.next_id == self._stamp + own_handles:
            self._stamp = RemovableHandle.next_id
        for carry, entries in zip(self._carried, self._entries):
            if not carry:
                for hooks, with_kwargs, i, _ in entries:
                    hooks.pop(i, None)
                    with_kwargs.pop(i, None)
        _disarm_classes(self._modules, self._refs, self._twins, self._live)
        self.armed = False

    def remove(self) -> None:
        """Removes every hook for good (through its handle); every module has its own class."""
        self.disarm()
        _forget_twins(self._twins)
        for kept in (self._modules, self._refs, self._index, self._tagged, self._twins, self._carried, self._entries):
            kept.clear()
        for h in self._handles:
            _OURS.discard(h.id)
            h.remove()
        self._handles.clear()


_SET_CLASS = object.__setattr__  # (not nn.Module.__setattr__, which looks through the module's dicts first)
_ARMED: dict[type, type] = {}  # a module class -> its armed twin
_OVER: dict[type, type] = {}  # a carrying class in use -> its subclass for a module another HookSet fills the dicts of
_ARMS: dict[int, tuple[weakref.ref, int]] = {}  # id(module) -> (module, how many armed HookSets hold it), while two are armed
_ARMED_SETS: dict[int, tuple[list, list[weakref.ref]]] = {}  # id(live) -> (live, refs) of every armed HookSet
_GLOBAL_HOOKS = (_module._global_forward_hooks, _module._global_forward_pre_hooks, _module._global_backward_hooks,
                 _module._global_backward_pre_hooks)  # (any of them: every module keeps its hooks in its dicts)


def _count(refs: list[weakref.ref]) -> None:
    """Counts one more armed HookSet holding each module of ``refs`` (weak references,
    which the count keeps, so that an id left by a module collected while armed is not taken
    for a later module's)."""
    for ref in refs:
        m = ref()
        if m is None:
            continue
        held = _ARMS.get(id(m))
        count = held[1] if held is not None and (held[0] is ref or held[0]() is m) else 0
        _ARMS[id(m)] = (ref, count + 1)


def _disarm_classes(modules: list[nn.Module], refs: list[weakref.ref], twins: list[type | None], live: list) -> None:
    """Each module's own class back once no armed HookSet holds it (and if nothing else gave
    it another class meanwhile, as ``fully_shard`` would). A module that another armed
    HookSet still holds (with its hooks in the dicts) gets the armed twin in place of the
    disarming set's carrying class (``twins``); another set's carrying class stays.
    ``live``: the disarming set's (armed, counted); a set that was armed alone throughout
    (not counted) only gives the classes back."""
    _ARMED_SETS.pop(id(live), None)
    counted, live[0], live[1] = live[1], False, False
    if not counted:
        for m in modules:
            base = _ORIGINAL.get(type(m))
            if base is not None:
                _SET_CLASS(m, "__class__", base)
        return
    for m, ref, twin in zip(modules, refs, twins):
        held = _ARMS.pop(id(m), None)
        left = held[1] - 1 if held is not None and (held[0] is ref or held[0]() is m) else 0
        cls = type(m)
        base = _ORIGINAL.get(cls)
        if left > 0:
            _ARMS[id(m)] = (held[0], left)
            if twin is not None and (cls is twin or cls.__base__ is twin):  # carried by this set: the other's are in the dicts
                _SET_CLASS(m, "__class__", armed_class(base))
            elif _OVER.get(cls.__base__) is cls:  # this set's hooks were in the dicts over the other's carrying class
                _SET_CLASS(m, "__class__", cls.__base__)
        elif base is not None:
            _SET_CLASS(m, "__class__", base)


def _forget_twins(twins: list[type | None], k: int | None = None) -> None:
    """Lets carrying classes go (``twins[k]``, or every one)."""
    for j in range(len(twins)) if k is None else (k,):
        twin, twins[j] = twins[j], None
        if twin is not None:
            _ORIGINAL.pop(twin, None)
            _ORIGINAL.pop(_OVER.pop(twin, None), None)
            release(twin)


def _dropped(live: list[bool], refs: list[weakref.ref], twins: list[type | None]) -> None:
    """A HookSet collected (its Recorder dropped without ``close()``): if it was armed, its
    modules get their classes back (their hooks left in dicts return at once, their capture
    gone), and its carrying classes go."""
    if live[0]:
        alive = [(m, ref, twin) for m, ref, twin in ((ref(), ref, twin) for ref, twin in zip(refs, twins)) if m is not None]
        _disarm_classes([m for m, _, _ in alive], [ref for _, ref, _ in alive], [twin for _, _, twin in alive], live)
    _forget_twins(twins)


def _no_hooks(state: dict) -> bool:
    """Whether a module (``state``: its ``__dict__``) has no hooks of anyone else's, which
    would run in another order around ours were ours carried by its class."""
    return not (state["_forward_hooks"] or state["_forward_pre_hooks"] or state["_backward_hooks"]
                or state["_backward_pre_hooks"])


def _with_dicts(cls: type) -> type:
    """The class of an armed module whose hooks are in its dicts: its armed twin; over
    another HookSet's carrying class, a subclass of that class (one per carrying class), so
    that Dynamo's type guard tells it from the module carried alone (Dynamo guards no hook
    dicts: the graph traced for the other set alone would run without this set's hooks)."""
    if cls not in _ORIGINAL:
        return _ARMED.get(cls) or armed_class(cls)
    if not is_carrying(cls):
        return cls
    over = _OVER.get(cls)
    if over is None:
        over = _OVER[cls] = _stand_in(cls)
        _ORIGINAL[over] = _ORIGINAL[cls]
    return over


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
        twin = _ARMED[cls] = _stand_in(cls)
        _ORIGINAL[twin] = cls
    return twin


def _stand_in(cls: type) -> type:
    """A subclass of ``cls`` that adds nothing but its own identity for Dynamo's type guard
    (same name, qualified name and module) and pickles as the module's own class."""
    return type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                       "__reduce_ex__": _reduce_as_original})


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
