"""``Recorder``: records the quantities of docs/quantities.md of a model for chosen training steps.

Usage::

    rec = gradscope.Recorder(model, optimizer=opt)
    model = torch.compile(model)          # optional, before or after the Recorder
    for step, batch in enumerate(loader):
        with rec.step(step):              # covers forward and backward
            loss = loss_fn(model(*batch)); loss.backward()
            rec.log("loss", loss)
        opt.step(); opt.zero_grad()
    df = rec.frame()

The capture lives inside the graph (:mod:`gradscope.recorder.capture.capture`): hooks are installed
when the Recorder is made and removed by ``close()``; steps that are not recorded pass
straight through them. Values stay on the device and reach the host once per recorded step.
The recorder never draws from the global RNG, never re-runs a module and never writes to
parameters, buffers or gradients, so training with and without it is bit-identical, eager
or compiled. Each quantity is a :class:`~gradscope.recorder.quantities.quantity.Quantity`: the
built-in ones are in :mod:`gradscope.recorder.quantities.registry`, and a user's own are instances
passed in ``quantities``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gradscope.recorder.capture.capture import Capture
from gradscope.recorder.step.checks import StepChecks
from gradscope.recorder.rows.late_rows import LateRows
from gradscope.recorder.discovery.layout import find_layout
from gradscope.recorder.options import RecorderOptions, moved_options, positional_names
from gradscope.recorder.rows.outlet import Outlet, make_sinks
from gradscope.recorder.capture.params import ParamGroups
from gradscope.recorder.quantities.registry import resolve_quantities
from gradscope.recorder.recorded_table import RecordedTable
from gradscope.recorder.replay.replay import ReplayOptions, SpikeReplay, replay_options
from gradscope.recorder.step.step_end import StepEnd
from gradscope.recorder.replay.step_runner import StepRunner
from gradscope.recorder.quantities.spike import SpikeDetector
from gradscope.recorder.capture.store import StepBuffer
from gradscope.recorder.capture.update_ratio import UpdateRatioHooks
from gradscope.recorder.capture.compile_settings import DonationOff, DynamoSettings
from gradscope.recorder.capture.cosine_rows import token_masks
from gradscope.recorder.discovery.wrappers import unwrap
from gradscope.recorder.numerics.collectives import dist_rank
from gradscope.recorder.step.arguments import checked_arguments, loggable, step_index
from gradscope.recorder.capture.scaler_watch import ScalerWatch, grad_scale, params_unscaled
from gradscope.sinks.base import RunInfo, Sink
from gradscope.table.keys import model_key
from gradscope.table.rows import RowStore

class Recorder(RecordedTable, StepRunner, StepEnd):
    """Records gradient norms and LayerNorm statistics of ``model``.

    It may be made before or after the model is compiled (a recorded module has a class of
    its own while its step records, so Dynamo traces it again with the hooks); a Recorder
    whose hooks never fire raises at the end of the step rather than returning an empty
    table.

    Args:
        model: a zoo model (also when wrapped, e.g. in a LightningModule or DDP) or any
            ``nn.Module`` (see ``gradscope.recorder.discovery.layout``). A
            ``DistributedDataParallel`` wrapper is unwrapped (sites and groups are named
            from ``model.module``), and so is a ``torch.compile`` wrapper; FSDP2
            (``fully_shard``) models are used as they are. Under ``torch.distributed`` see
            :mod:`gradscope.distributed`.
        quantities: ``"default"`` (norms, ln_gain, loss, lr, nonfinite), ``"all"`` (every
            quantity of the seeds' papers), ``"signals"`` (default plus the signals before
            instability: attention logits and entropy, output log Z, sub-layer RMS, gradient
            RMS over Adam's ε), or a list of built-in quantity names and
            :class:`gradscope.Quantity` instances (a user's own quantities).
        every: record steps whose index is a multiple of ``every`` (default 1).
        slow_every: cosine and update_ratio are taken on recorded steps that are
            multiples of this (default 10).
        sites: shell-style patterns selecting sites (default: all).
        run: value of the ``run`` column (default: the name of ``log_dir``, else ``"run"``).
        optimizer: when given, ``lr`` is read from it and ``update_ratio`` (‖Δθ‖/‖θ‖ per
            group) is measured around its ``step``.
        scaler: a ``torch.amp.GradScaler``; gradient norms are divided by its scale so the
            table holds unscaled values (a user quantity's ``site_grad`` sees the gradient
            as backward has it, scaled).
        log_dir: stream the rows to a parquet dataset in this folder
            (:class:`gradscope.sinks.ParquetSink`) instead of keeping them in memory;
            ``frame()`` then reads them back and ``gradscope.load(log_dir)`` reads the run.
        flush_every: with ``log_dir``, recorded steps buffered before a part file is
            written (default 100): at most this many are lost if the process is killed.
        sinks: more :class:`gradscope.sinks.Sink` s that receive every row as it is
            recorded (``TensorBoardSink``, ``WandbSink``); closed by ``close()``.
        on_spike: ``"replay"`` (or a :class:`~gradscope.recorder.replay.replay.ReplayOptions`):
            watch every step opened by :meth:`run` (or ``begin_step`` and
            :meth:`check_spike`) for a loss or gradient-norm spike and record a spiking step
            that the schedule skips by running it again (:mod:`gradscope.recorder.replay.replay`);
            None (default): no watch.
        options: the settings most runs leave alone (``variant``, ``rank``, ``reduction``,
            ``cosine_tokens``, ``max_calls``, ``seed``): :class:`RecorderOptions`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        quantities: str | tuple | list = "default",
        every: int = 1,
        slow_every: int = 10,
        sites: list[str] | None = None,
        run: str | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scaler=None,
        log_dir: str | os.PathLike | None = None,
        flush_every: int = 100,
        sinks: list[Sink] | tuple = (),
        options: RecorderOptions | None = None,
        on_spike: str | ReplayOptions | None = None,
        **moved,
    ) -> None:
        options = moved_options(moved) or options or RecorderOptions()
        every, slow_every = checked_arguments(model, every=every, slow_every=slow_every, optimizer=optimizer, run=run)
        watch = replay_options(on_spike)
        model = unwrap(model)
        self.model = model
        self._quantities = resolve_quantities(quantities)
        self._named = set() if isinstance(quantities, str) else {q for q in quantities if isinstance(q, str)}
        self.quantities = tuple(self._quantities)
        self.every, self.slow_every = every, slow_every
        self.layout = find_layout(model, sites)
        if self.layout.not_norms:
            warnings.warn(f"gradscope: {self.layout.not_norms[:4]}{' ...' if len(self.layout.not_norms) > 4 else ''} "
                          "are named *Norm but hold parameters of more than one dimension (a per-head gain, as "
                          "Cohere's q/k norms), which the recorder does not read as a norm: they have no norm sites, "
                          "ln_gain or w/sigma rows", stacklevel=2)
        self.groups = ParamGroups(model, self.layout)
        self.run_name = run if run is not None else Path(log_dir).name if log_dir is not None else "run"
        config = getattr(model, "config", None)
        self.variant = options.variant or getattr(config, "variant", None) or type(model).__name__
        self.optimizer, self.scaler, self.options = optimizer, scaler, options
        self._scaler_watch = ScalerWatch(scaler)  # the scale of the step's backward, and whether it was unscaled since
        self.cosine_tokens, self.reduction = options.cosine_tokens, options.reduction
        self.rank = options.rank if options.rank is not None else dist_rank()
        self._generator = torch.Generator().manual_seed(options.seed)
        self._store = RowStore()
        watched = tuple(n for n, q in self._quantities.items() if q.spike_watched)
        self._out = Outlet(self._store, make_sinks(log_dir, flush_every, sinks),
                           RunInfo(self.run_name, self.variant, self.rank, self.reduction),
                           SpikeDetector(watch=watched) if "spike" in self._quantities else None)
        self._forward_params = positional_names(model)
        self._value_stats = tuple(n for n, q in self._quantities.items() if q.takes_site_values)
        self._grad_stats = tuple(n for n, q in self._quantities.items() if q.takes_site_grads)
        # (a function of the model alone: the capture holds no Recorder, and Dynamo traces it)
        masks = functools.partial(token_masks, model, [s.name for s in self.layout.stacks], self._forward_params)
        self._capture = Capture(model, self.layout, options.max_calls, masks,
                                value_stats=[self._quantities[n].site_value for n in self._value_stats],
                                grad_stats=[self._quantities[n].site_grad for n in self._grad_stats])
        self._capture.install(frozenset().union(*(q.captures for q in self._quantities.values())))
        if self._scaler_watch.scaler is not None:  # (the scale each backward ran with: recorder/scaler_watch.py)
            self._capture.after_backward = self._scaler_watch.backward_ended
        self._checks = StepChecks(model, self.layout, self._capture.points, options.max_calls, self._capture.grad_expected)
        self._wants: set[str] = set()
        self._buffer: StepBuffer | None = None
        self._step: int | None = None
        self._recording = False
        self._late = LateRows(self._out, self._rows)  # a step's rows are built later (recorder/late_rows.py)
        self._key_cache: dict = {}  # row keys kept from step to step (StepData.step_keys)
        self._updates = UpdateRatioHooks(self.groups, self._late.rows, self._checks.warn_once)
        self._closed = self._closed_inside = False
        self._lr_from_optimizer = optimizer is not None
        self._lr_logged, self._lr_checks = False, 0  # (a loop that logs lr itself: StepEnd._lr_unlogged)
        self._watching = watch is not None  # (the optimizer's step hooks then also tell Recorder.run a step inside it)
        if optimizer is not None:
            self.attach_optimizer(optimizer)
        self._replay = SpikeReplay(self, model, watch, self._grad_scale) if watch is not None else None
        DynamoSettings.acquire(len(self._capture.hooks.modules))  # compiled: checkpointing, blocks compiled one by one
        self._release_settings = weakref.finalize(self, DynamoSettings.release)  # by close(), or when collected
        weakref.finalize(self, self._capture.dropped)  # (a Recorder collected inside a step disarms its hooks)
        self._donation_off = [False]  # whether this Recorder's open step holds DonationOff
        weakref.finalize(self, DonationOff.give_back, self._donation_off)  # (given back by a Recorder collected inside a step)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Measures ``update_ratio`` around ``optimizer.step()`` (hooks removed by ``close``).

        A training loop that builds its own optimizer calls this; ``lr`` is then left to the
        loop's own ``log("lr", ...)`` unless the optimizer was given to the constructor.
        """
        self.optimizer = optimizer
        self._scaler_watch.attach(optimizer)
        self._updates.remove()
        if "update_ratio" in self.quantities or "lr" in self.quantities or self._watching:  # (lr: the one an update inside the step used)
            self._updates.attach(optimizer)

    # -- the step context ----------------------------------------------------------------
    def records(self, step: int) -> bool:
        """Whether ``step`` is recorded."""
        return step % self.every == 0

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator["Recorder"]:
        """Records one training step: enter before the forward, leave after ``backward()``."""
        self.begin_step(step)
        try:
            yield self
        except BaseException:
            self.abort_step()
            raise
        self.end_step()

    def begin_step(self, step: int, *, replay: bool = False) -> bool:
        """Opens step ``step`` (for callbacks; prefer the ``step`` context). Returns whether it is recorded.

        With ``on_spike`` it takes the RNG states a replay restores. ``replay=True`` records
        the step whatever the schedule, with every quantity (slow ones too).
        """
        if self._closed:
            raise RuntimeError("Recorder.step: the recorder is closed")
        step = step_index(step)
        if self._step is not None:
            raise RuntimeError(f"Recorder.step({step}): step {self._step} is still open (steps do not nest)")
        self._step = step
        try:
            return self._open(step, replay)
        except BaseException:  # (a sink's write that failed, say): the step is not left open
            self.abort_step()
            raise

    def _open(self, step: int, replay: bool) -> bool:
        self._updates.expire(step, self._checks.warn_once)
        if self._replay is not None and not replay:
            self._replay.before()
        if not (replay or self.records(step)):
            self._out.ran(step)  # (a resumed run that runs a step owns it in log_dir: recorded or not)
            return False
        self._checks.begin(step)
        self._late.begin(step)
        slow = replay or step % (self.every * self.slow_every) == 0
        self._wants = {n for n, q in self._quantities.items() if slow or not q.slow}
        if "update_ratio" in self._wants and self.optimizer is not None:
            self._updates.open(step)  # the next optimizer.step(), inside the step or after it
        elif "update_ratio" in self._wants and "update_ratio" in self._named:
            self._checks.warn_once("update_ratio", "update_ratio is measured around optimizer.step(): give the "
                                   "Recorder the optimizer (Recorder(model, optimizer=opt), or rec.attach_optimizer(opt)); "
                                   "until then it has no rows")
        captures = set().union(*(self._quantities[q].captures for q in self._wants))
        stats = any(n in self._wants for n in self._value_stats + self._grad_stats)
        self._buffer = StepBuffer()
        self._scaler_watch.begin()
        self._updates.step_open, self._updates.lr_used = True, None
        self._capture.begin(self._device(), captures, cosine_tokens=self.cosine_tokens, generator=self._generator,
                            stats=stats)
        DonationOff.take(self._donation_off)  # (a recorded graph's backward may run twice: wrappers.py)
        self._recording = True
        return True

    def end_step(self) -> None:
        """Closes the open step after backward and stores the step's rows."""
        if self._step is None:
            if self._closed_inside:  # (close() discarded the step, and said so)
                self._closed_inside = False
                return
            raise RuntimeError("Recorder.end_step: no open step" + (" (the recorder is closed)" if self._closed else ""))
        step = self._step
        try:
            if self._recording:
                self._finish(step, self._wants)
        finally:
            self._capture.on = False
            self._scaler_watch.end()
            self._updates.step_open = False
            self._step, self._buffer, self._recording = None, None, False
            DonationOff.give_back(self._donation_off)

    def abort_step(self) -> None:
        """Discards the open step (after an exception): nothing stored."""
        self._capture.discard()
        self._scaler_watch.end()
        self._updates.step_open = False
        self._updates.pending = None
        self._step, self._buffer, self._recording = None, None, False
        DonationOff.give_back(self._donation_off)

    @contextlib.contextmanager
    def paused(self) -> Iterator["Recorder"]:
        """Inside, the open step records nothing: an evaluation forward run between a step's
        micro-batches (a Lightning validation loop in the middle of gradient accumulation)
        neither adds to ``act_norm`` nor starts a micro-step. Outside a recorded step it
        does nothing.

        A compiled model called inside compiles once more (its hooks are armed but silent).
        """
        capture, was = self._capture, self._capture.on
        capture.on = False
        try:
            yield self
        finally:
            capture.on = was and self._recording

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (the table stays readable; no step can open)."""
        return self._closed

    @property
    def open_step(self) -> int | None:
        """The step currently open, or None."""
        return self._step

    def log(self, quantity: str, value: float | torch.Tensor, *, step: int | None = None) -> None:
        """Logs a scalar (``loss``, ``val_loss``, ...) for the open step, or for ``step``.

        Tensors stay on the device until the step's single host transfer. Outside an open
        step, ``step`` must be given and the value is stored at once. Logged several times
        in one step (once per micro-batch), a quantity gets rows with micro_step 0, 1, ...
        and their mean as the step's row (micro_step -1).
        """
        elements = value.numel() if isinstance(value, torch.Tensor) else value.size if isinstance(value, np.ndarray) else 1
        if elements != 1:
            raise ValueError(f"Recorder.log({quantity!r}, ...): the value must be a scalar (a number, or a tensor or "
                             f"array of one element), got {type(value).__name__} of shape {tuple(value.shape)}")
        if isinstance(value, np.ndarray):
            value = value.item()  # (one element: np.array([2.5]))
        key = model_key(loggable(quantity, value, lr_from_optimizer=self._lr_from_optimizer))
        self._lr_logged = self._lr_logged or quantity == "lr"
        if self._buffer is not None and step in (None, self._step):
            if isinstance(value, torch.Tensor):
                self._buffer.add(key, value.detach().float().reshape(()))
            else:
                self._buffer.add_float(key, value)
            return
        if step is None:
            if self._step is None:
                raise ValueError("Recorder.log: the recorder is closed, and no step is open" if self._closed
                                 else "Recorder.log: no open step; pass step=")
            return  # the open step is not recorded: nothing to log
        self._late.rows(step, [key], np.array([float(value)]))

    def _device(self) -> torch.device:
        return self.groups.device()

    def _grad_scale(self) -> torch.Tensor | None:
        """The scale the watch divides the gradients' norm by: None once ``scaler.unscale_``
        ran (inside the closure, say), as the gradients are unscaled then."""
        return None if params_unscaled(self.scaler) else grad_scale(self.scaler)

    def close(self) -> None:
        """Removes every hook (module, tensor and optimizer) and flushes and closes the sinks;
        the recorded table stays readable. A step still open is discarded, with a warning."""
        if self._step is not None:
            warnings.warn(f"gradscope: Recorder.close() inside step {self._step}: the step is discarded (no rows); "
                          "close the recorder after the step ends", stacklevel=2)
            self.abort_step()
            self._closed_inside = True  # (the step's own end then does nothing)
        if self._lr_checks and self.optimizer is None:
            self._lr_unlogged(closing=True)
        self._release_settings()  # once, whatever calls it first
        self._capture.remove()
        self._updates.remove()
        self._scaler_watch.remove()
        self._closed = True
        try:
            self._late.drain()
        finally:
            self._out.close()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def site_names(self) -> list[str]:
        """The sites this recorder probes."""
        return self.layout.site_names()
