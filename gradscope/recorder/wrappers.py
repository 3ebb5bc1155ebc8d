"""What the Recorder needs to know of the model's surroundings: wrappers, ranks, autocast."""

from __future__ import annotations

import contextlib

import torch
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
    if device is None:
        yield
        return
    with torch.autocast(device_type=device.type, enabled=False):
        yield


def dist_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


class HookGuards:
    """The two Dynamo settings a Recorder needs, set while any Recorder is open and restored
    when the last one closes.

    - ``skip_nnmodule_hook_guards=False``: by default Dynamo does not guard on module hooks,
      so a compiled model of one class may run the graph traced from another instance of
      that class, hooks or no hooks, and a Recorder on the second would see no hook fire.
      With the guards on, an instance with the recorder's hooks and one without each get
      their own graph.
    - ``skip_fwd_side_effects_in_bwd_under_checkpoint=True``: the recorder's hooks count
      calls (a Python side effect) inside a checkpointed forward, which Dynamo refuses under
      ``fullgraph=True`` ("HOP: Unsafe side effect"). Skipping forward side effects when
      backward recomputes is what the recorder wants anyway: a recomputed call is not a new
      call.
    """

    _open = 0
    _saved: dict[str, object] | None = None
    SETTINGS = {"skip_nnmodule_hook_guards": False, "skip_fwd_side_effects_in_bwd_under_checkpoint": True}

    @classmethod
    def acquire(cls) -> None:
        config = torch._dynamo.config
        if cls._open == 0:
            cls._saved = {k: getattr(config, k) for k in cls.SETTINGS if hasattr(config, k)}
            for k in cls._saved:
                setattr(config, k, cls.SETTINGS[k])
        cls._open += 1

    @classmethod
    def release(cls) -> None:
        if cls._open == 0:
            return
        cls._open -= 1
        if cls._open == 0 and cls._saved is not None:
            for k, v in cls._saved.items():
                setattr(torch._dynamo.config, k, v)


def grad_scale(scaler) -> torch.Tensor | None:
    """A ``torch.amp.GradScaler``'s current scale as a 0-d fp32 tensor (no host sync), or None
    without an enabled scaler."""
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler._get_scale_async().detach().float().reshape(())


def params_unscaled(scaler) -> bool:
    """Whether the user already called ``scaler.unscale_(optimizer)`` this step (True without
    an enabled scaler)."""
    if scaler is None or not scaler.is_enabled():
        return True
    from torch.amp.grad_scaler import OptState

    return any(s.get("stage") is OptState.UNSCALED for s in scaler._per_optimizer_states.values())


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
