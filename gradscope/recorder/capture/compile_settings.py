"""The torch settings a recorded step needs under ``torch.compile``, taken while any Recorder
needs them and given back after: :class:`DynamoSettings` (Dynamo's) and :class:`DonationOff`
(AOTAutograd's donated buffers)."""

from __future__ import annotations

import torch
import torch._functorch.config as functorch_config
import torch.compiler.config as compiler_config


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
    (:mod:`gradscope.recorder.capture.hookset`).
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

