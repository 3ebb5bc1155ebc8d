"""What the Recorder needs to know of the model's surroundings: wrappers, ranks, autocast."""

from __future__ import annotations

import contextlib
import numbers

import torch
import torch._functorch.config as functorch_config
import torch.compiler.config as compiler_config
from torch import nn

from gradscope.recorder.layout import is_zoo


def unwrap(model: nn.Module) -> nn.Module:
    """The model to record inside wrappers: DDP's ``.module``, ``torch.compile``'s
    ``_orig_mod``, and a zoo model held by a LightningModule or similar, so that site names
    stay canonical."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            break
    if is_zoo(model):
        return model
    return next((m for m in model.modules() if is_zoo(m)), model)


def grad_versions(model: nn.Module) -> list:
    """(id, version) of every parameter's gradient: tells whether backward ran in a step."""
    return [None if p.grad is None else (id(p.grad), p.grad._version) for p in model.parameters()]


@contextlib.contextmanager
def no_autocast(device: torch.device | None):
    """Autocast off for ``device`` inside (entered only where it is on: building a
    ``torch.autocast`` costs more than the check)."""
    if device is None or not torch.is_autocast_enabled(device.type):
        yield
        return
    with torch.autocast(device_type=device.type, enabled=False):
        yield


def dist_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


class DynamoSettings:
    """The Dynamo settings a Recorder needs, set while any Recorder is open and restored when
    the last one closes.

    - ``skip_fwd_side_effects_in_bwd_under_checkpoint=True``: the recorder's hooks count calls
      (a Python side effect) inside a checkpointed forward, which Dynamo refuses under
      ``fullgraph=True`` ("HOP: Unsafe side effect"). Skipping forward side effects when
      backward recomputes is what the recorder wants anyway: a recomputed call is not a new
      call.
    - ``recompile_limit`` at least ``modules`` + 8 (and ``accumulated_recompile_limit`` twice
      that), ``modules`` being the recorded modules: blocks compiled one by one
      (torchtitan-style) share their forward's code, and each block's recorded graph writes
      into slots of its own, so a recorded step compiles one graph per block (plus the
      unrecorded one they share). Past Dynamo's default of 8 a ``fullgraph=True`` compile
      fails; a limit that is already higher stays.

    Module hooks need no setting: an armed module has a class of its own
    (:mod:`gradscope.recorder.hookset`).
    """

    _open = 0
    _saved: dict[str, object] | None = None
    SETTINGS = {"skip_fwd_side_effects_in_bwd_under_checkpoint": True}

    @classmethod
    def acquire(cls, modules: int = 0) -> None:
        """One more Recorder open, of ``modules`` recorded modules."""
        config = torch._dynamo.config
        wanted = dict(cls.SETTINGS)
        if hasattr(config, "recompile_limit"):
            wanted["recompile_limit"] = modules + 8
            wanted["accumulated_recompile_limit"] = 2 * (modules + 8)
        if cls._open == 0:
            cls._saved = {k: getattr(config, k) for k in wanted if hasattr(config, k)}
        for k in cls._saved or {}:
            v = wanted[k]
            setattr(config, k, max(v, getattr(config, k)) if isinstance(v, int) and not isinstance(v, bool) else v)
        cls._open += 1

    @classmethod
    def release(cls) -> None:
        """One Recorder fewer open; the last one restores the settings."""
        if cls._open == 0:
            return
        cls._open -= 1
        if cls._open == 0 and cls._saved is not None:
            for k, v in cls._saved.items():
                setattr(torch._dynamo.config, k, v)


class DonationOff:
    """AOTAutograd's donated buffers are off while any Recorder's step records
    (``torch._functorch.config.donated_buffer``); the last step to end restores the settings.

    A backward compiled with donated buffers overwrites the tensors saved for it, which is
    safe only for a backward that runs once: AOTAutograd compiles the backward lazily and
    drops the donation when the first backward keeps the graph (``retain_graph=True``). A
    recorded graph holds the taps' ``autograd.Function`` (the higher-order op
    ``autograd_function_apply``), which AOTAutograd's cache does not take, so its compiled
    backward comes from Inductor's FX graph cache alone, whose key does not hold that
    choice. On torch 2.13, a step that called ``backward(retain_graph=True)`` and then
    ``backward()`` was handed a donating backward compiled earlier for a step of one
    backward (by another copy of the model, or an earlier process), and the second
    backward's parameter gradients came out wrong (45–91 % off), silently. With donation
    off in recorded steps, no recorded graph's backward overwrites what it saved: the same
    numbers, and a larger backward peak of memory in recorded steps, by the saved tensors
    that donation would have reused. Unrecorded steps compile and run the plain graph,
    donation as the user has it.

    The compile caches' key tag (``torch.compiler.config.cache_key_tag``) gets
    :data:`CACHE_TAG` appended for as long, so a recorded graph is compiled and cached
    under keys of its own: a donating backward that an older gradscope left in Inductor's
    cache (same graph, same key but for the donation) is never served to it. (The tag is
    also in Dynamo's profile key for automatic dynamic shapes when the user sets
    ``torch.compiler.config.job_id``: a graph first compiled in a recorded step files its
    profile under the tagged key.) Both settings cost ≈ 11 µs a recorded step (four reads and four writes of
    torch's config modules, timed warm on the AMD VM).
    """

    CACHE_TAG = "gradscope-recorded-no-donation"
    _held = 0  # recorded steps open now, over every Recorder
    _saved: tuple[bool, str] | None = None  # the user's (donated_buffer, cache_key_tag)
    _tag = ""  # the tag set

    @classmethod
    def take(cls, held: list[bool]) -> None:
        """A Recorder's step begins to record; ``held[0]`` notes that it holds the setting."""
        if held[0]:
            return
        held[0] = True
        if cls._held == 0:
            cls._saved = functorch_config.donated_buffer, compiler_config.cache_key_tag
            cls._tag = f"{cls._saved[1]}+{cls.CACHE_TAG}" if cls._saved[1] else cls.CACHE_TAG
            functorch_config.donated_buffer, compiler_config.cache_key_tag = False, cls._tag
        cls._held += 1

    @classmethod
    def give_back(cls, held: list[bool]) -> None:
        """The step ended (or was aborted, or its Recorder collected): gives its hold back,
        once; the last one restores the user's settings, unless the user changed them since
        (a ``donated_buffer`` set to False inside the step cannot be told from ours)."""
        if not held[0]:
            return
        held[0] = False
        cls._held -= 1
        if cls._held == 0:  # (what the user set inside the step stays)
            if functorch_config.donated_buffer is False:
                functorch_config.donated_buffer = cls._saved[0]
            if compiler_config.cache_key_tag == cls._tag:
                compiler_config.cache_key_tag = cls._saved[1]


def checked_arguments(model, *, every, slow_every, optimizer, run) -> tuple[int, int]:
    """``(every, slow_every)`` as ints, after checking the Recorder's arguments whose mistakes
    would otherwise surface later and elsewhere.

    Raises:
        TypeError: ``model`` is no ``nn.Module``, ``optimizer`` has no ``param_groups``,
            ``run`` is no string.
        ValueError: ``every`` or ``slow_every`` is not an integer >= 1.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"Recorder: model must be a torch.nn.Module (or its torch.compile or DDP wrapper), "
                        f"got {type(model).__name__}")
    if optimizer is not None and not hasattr(optimizer, "param_groups"):
        raise TypeError(f"optimizer: the optimizer that steps this model (a torch.optim.Optimizer, with "
                        f"param_groups), got {optimizer!r}")
    if run is not None and not isinstance(run, str):
        raise TypeError(f"run: the run's name, a string, got {run!r}")
    for name, value in (("every", every), ("slow_every", slow_every)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    return int(every), int(slow_every)


def step_index(step) -> int:
    """A training step's index as an int (numpy integers too).

    Raises:
        TypeError: ``step`` is not an integer (a float, a string, None, a bool).
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"Recorder.step: the step must be an integer (the global training step), got {step!r}")
    return int(step)


def loggable(quantity: str, value, *, lr_from_optimizer: bool) -> str:
    """``quantity`` if ``Recorder.log`` may write it: a name, not one the Recorder computes
    itself (two rows under one key, or one hidden; ``lr`` only while the Recorder reads it
    from the optimizer), with a number for a value.

    Raises:
        ValueError: an empty name, or one the Recorder computes.
        TypeError: the value is no number (nothing ``float()`` takes, or a bool or string)
            and no tensor.
    """
    from gradscope.recorder.quantities import REGISTRY  # (here: quantities imports checks, which imports this module)

    if not isinstance(quantity, str) or not quantity:
        raise ValueError(f"Recorder.log: the quantity must be a non-empty name, got {quantity!r}")
    own = REGISTRY.get(quantity)
    written_by_log = getattr(own, "logged", False) or getattr(own, "logged_by_gradscope", False)
    if own is not None and not written_by_log and (quantity != "lr" or lr_from_optimizer):
        raise ValueError(f"Recorder.log({quantity!r}, ...): {quantity!r} is a quantity the Recorder computes itself"
                         + (" (from the optimizer it was given)" if quantity == "lr" else "")
                         + "; log your value under another name")
    if isinstance(value, (str, bytes, bool)) or not (isinstance(value, torch.Tensor) or hasattr(value, "__float__")):
        raise TypeError(f"Recorder.log({quantity!r}, ...): the value must be a number or a one-element tensor, "
                        f"got {type(value).__name__}")
    return quantity


def token_masks(model: nn.Module, stacks: list[str], forward_params: list[str], args: tuple,
                kwargs: dict) -> dict[str, torch.Tensor]:
    """Stack -> (B, T) bool mask of real tokens for ``cosine``, asked of the model
    (``model.token_masks(*args, **kwargs)``) or, for HuggingFace models, ``attention_mask``
    for the first (encoder) stack and ``decoder_attention_mask`` for a second: an encoder's
    padding never weights a decoder. ``forward_params``: the forward's parameter names, to
    find a mask passed by position."""
    own = getattr(model, "token_masks", None)
    if callable(own):
        return own(*args, **kwargs)
    masks = {}
    for name, key in zip(stacks, ("attention_mask", "decoder_attention_mask")):
        mask = kwargs.get(key)
        at = forward_params.index(key) if key in forward_params else len(args)
        if mask is None and at < len(args):
            mask = args[at]  # passed by position
        if isinstance(mask, torch.Tensor):
            masks[name] = mask.bool()
    return masks
