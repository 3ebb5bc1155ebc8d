"""``Recorder``: records the quantities of docs/quantities.md of a model for chosen training
steps (usage and how the parts fit: :mod:`gradscope.recorder`). The Recorder composes the
parts; each owns its state."""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

from gradscope.recorder.capture.capture import Capture
from gradscope.recorder.capture.compile_settings import DynamoSettings
from gradscope.recorder.capture.cosine_rows import token_masks
from gradscope.recorder.capture.params import ParamGroups
from gradscope.recorder.capture.scaler_watch import ScalerWatch
from gradscope.recorder.capture.optimizer_step import UPDATE_QUANTITIES, OptimizerStepHooks, update_rows
from gradscope.recorder.discovery.layout import find_layout
from gradscope.recorder.discovery.wrappers import unwrap
from gradscope.recorder.numerics.collectives import dist_rank
from gradscope.recorder.options import RecorderOptions, moved_options, positional_names
from gradscope.recorder.quantities.built_in import LrSource
from gradscope.recorder.quantities.registry import resolve_quantities
from gradscope.recorder.quantities.spike import SpikeDetector
from gradscope.recorder.replay.replay import Reading, ReplayOptions, SpikeReplay, SpikeWatch, replay_options
from gradscope.recorder.rows.late_rows import LateRows
from gradscope.recorder.rows.outlet import Outlet, make_sinks
from gradscope.recorder.recorded_table import RecordedTable
from gradscope.recorder.step.arguments import checked_arguments, log_key, step_index, warn_unmeasurable
from gradscope.recorder.step.checks import StepChecks
from gradscope.recorder.session import StepSession
from gradscope.recorder.step.step_end import StepEnd
from gradscope.sinks.base import RunInfo, Sink
from gradscope.table.rows import RowStore


class Recorder:
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
            RMS over Adam's ε), ``"moe"`` (default plus MoE routing and per-expert norms: docs/moe.md),
            or a list of built-in quantity names and :class:`gradscope.Quantity` instances.
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
        named = set() if isinstance(quantities, str) else {q for q in quantities if isinstance(q, str)}
        self.quantities = tuple(self._quantities)
        self.every, self.slow_every = every, slow_every
        self.layout = find_layout(model, sites)
        self.layout.warn_not_norms()
        warn_unmeasurable(self._quantities, named, self.layout)
        self.groups = ParamGroups(model, self.layout)
        self.run_name = run if run is not None else Path(log_dir).name if log_dir is not None else "run"
        self.variant = options.variant or getattr(getattr(model, "config", None), "variant", None) or type(model).__name__
        self.optimizer, self.scaler, self.options = optimizer, scaler, options
        self._scaler_watch = ScalerWatch(scaler)  # the scale of the step's backward, and whether it was unscaled since
        self.cosine_tokens, self.reduction = options.cosine_tokens, options.reduction
        self.rank = options.rank if options.rank is not None else dist_rank()
        self._generator = torch.Generator().manual_seed(options.seed)
        self._store = RowStore()
        info = RunInfo(self.run_name, self.variant, self.rank, self.reduction)
        spikes = SpikeDetector(watch=tuple(n for n, q in self._quantities.items() if q.spike_watched))
        self._out = Outlet(self._store, make_sinks(log_dir, flush_every, sinks), info,
                           spikes if "spike" in self._quantities else None)
        # the quantities whose site_value / site_grad the capture takes, in its channel order
        value_stats = tuple(n for n, q in self._quantities.items() if q.takes_site_values)
        grad_stats = tuple(n for n, q in self._quantities.items() if q.takes_site_grads)
        # (a function of the model alone: the capture holds no Recorder, and Dynamo traces it)
        masks = functools.partial(token_masks, model, [s.name for s in self.layout.stacks], positional_names(model))
        self._capture = Capture(model, self.layout, options.max_calls, masks,
                                value_stats=[self._quantities[n].site_value for n in value_stats],
                                grad_stats=[self._quantities[n].site_grad for n in grad_stats], groups=self.groups)
        self._capture.install(frozenset().union(*(q.captures for q in self._quantities.values())))
        if self._scaler_watch.scaler is not None:  # (the scale each backward ran with: capture/scaler_watch.py)
            self._capture.after_backward = self._scaler_watch.backward_ended
        cap = self._capture
        self._checks = StepChecks(self.groups, self.layout, cap.sites, options.max_calls, cap.grad_expected, sites_hooked=cap.sites_hooked)
        self._lr = LrSource(from_optimizer=optimizer is not None, asked="lr" in named)
        end = StepEnd(model=model, layout=self.layout, groups=self.groups, capture=self._capture,
                      scaler_watch=self._scaler_watch, checks=self._checks, quantities=self._quantities,
                      value_stats=value_stats, grad_stats=grad_stats, lr=self._lr)
        self._late = LateRows(self._out, end.rows)  # a step's rows are built later (rows/late_rows.py)
        late, warn, quantities = self._late, self._checks.warn_once, self._quantities  # (hooks that hold no Recorder)
        self._updates = OptimizerStepHooks(
            self.groups, lambda u: late.rows(u.step, *update_rows(quantities, u, warn)), warn)
        self._session = StepSession(capture=self._capture, checks=self._checks, late=self._late, outlet=self._out,
                                    updates=self._updates, scaler_watch=self._scaler_watch, end=end,
                                    quantities=self._quantities, named=named, every=every, slow_every=slow_every,
                                    cosine_tokens=self.cosine_tokens, generator=self._generator, device=self.groups.device)
        self._closed = self._closed_inside = False
        self._watching = watch is not None  # (the optimizer's step hooks then also tell Recorder.run a step inside it)
        if optimizer is not None:
            self.attach_optimizer(optimizer)
        self._replay = SpikeReplay(self, model, watch, self._scaler_watch.scale_now) if watch is not None else None
        self._table = RecordedTable(late=self._late, outlet=self._out, store=self._store, generator=self._generator,
                                    checks=self._checks, info=info, watch=self.watch)
        DynamoSettings.acquire(len(self._capture.hooks.modules))  # compiled: checkpointing, blocks compiled one by one
        self._release_settings = weakref.finalize(self, DynamoSettings.release)  # by close(), or when collected
        weakref.finalize(self, self._capture.dropped)  # (a Recorder collected inside a step disarms its hooks)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Measures ``update_ratio`` around ``optimizer.step()`` (hooks removed by ``close``).

        A training loop that builds its own optimizer calls this; ``lr`` is then left to the
        loop's own ``log("lr", ...)`` unless the optimizer was given to the constructor.
        """
        self.optimizer = optimizer
        self._scaler_watch.attach(optimizer)
        self._updates.remove()
        if UPDATE_QUANTITIES & set(self.quantities) or "lr" in self.quantities or self._watching:  # (lr: the one an update used)
            self._updates.attach(optimizer)

    # -- the step context ----------------------------------------------------------------
    def records(self, step: int) -> bool:
        """Whether ``step`` is recorded."""
        return self._session.records(step)

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
        if self._session.step is not None:
            raise RuntimeError(f"Recorder.step({step}): step {self._session.step} is still open (steps do not nest)")
        try:
            if self._replay is not None and not replay:
                self._replay.before()
            return self._session.open(step, replay=replay, optimizer=self.optimizer)
        except BaseException:  # (a sink's write that failed, say): the step is not left open
            self.abort_step()
            raise

    def end_step(self) -> None:
        """Closes the open step after backward and stores the step's rows."""
        if self._session.step is None:
            if self._closed_inside:  # (close() discarded the step, and said so)
                self._closed_inside = False
                return
            raise RuntimeError("Recorder.end_step: no open step" + (" (the recorder is closed)" if self._closed else ""))
        self._session.close(optimizer=self.optimizer)

    def abort_step(self) -> None:
        """Discards the open step (after an exception): nothing stored."""
        self._session.discard()

    @contextlib.contextmanager
    def paused(self) -> Iterator["Recorder"]:
        """Inside, the open step records nothing: an evaluation forward run between a step's
        micro-batches (a Lightning validation loop in the middle of gradient accumulation)
        neither adds to ``act_norm`` nor starts a micro-step. Outside a recorded step it
        does nothing.

        A compiled model called inside compiles once more (its hooks are armed but silent).
        """
        with self._session.paused():
            yield self

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (the table stays readable; no step can open)."""
        return self._closed

    @property
    def open_step(self) -> int | None:
        """The step currently open, or None."""
        return self._session.step

    def log(self, quantity: str, value: float | torch.Tensor, *, step: int | None = None) -> None:
        """Logs a scalar (``loss``, ``val_loss``, ...) for the open step, or for ``step``.

        Tensors stay on the device until the step's single host transfer. Outside an open
        step, ``step`` must be given and the value is stored at once. Logged several times
        in one step (once per micro-batch), a quantity gets rows with micro_step 0, 1, ...
        and their mean as the step's row (micro_step -1).
        """
        key, value = log_key(quantity, value, lr_from_optimizer=self._lr.from_optimizer)
        self._lr.log(quantity)
        if self._session.log(key, value, step):
            return
        if step is None:
            if self._session.step is None:
                raise ValueError("Recorder.log: the recorder is closed, and no step is open" if self._closed
                                 else "Recorder.log: no open step; pass step=")
            return  # the open step is not recorded: nothing to log
        self._session.log_later(key, value, step)

    def close(self) -> None:
        """Removes every hook (module, tensor and optimizer) and flushes and closes the sinks;
        the recorded table stays readable. A step still open is discarded, with a warning."""
        if self._session.step is not None:
            warnings.warn(f"gradscope: Recorder.close() inside step {self._session.step}: the step is discarded (no rows); "
                          "close the recorder after the step ends", stacklevel=2)
            self.abort_step()
            self._closed_inside = True  # (the step's own end then does nothing)
        self._lr.closing(self.optimizer, self._checks.warn_once)
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

    # -- a step run as a closure, and the spike watch (replay/replay.py) -------------------
    def run(self, step: int, closure: Callable[[], Any], *, log_loss: bool = True) -> Any:
        """Runs one training step's forward and backward (all its micro-batches) as ``closure()``.

        The step is recorded when the schedule says so; with ``on_spike="replay"`` every step
        is watched and a spiking step the schedule skips is run again, recorded
        (:mod:`gradscope.recorder.replay.replay`), its gradients left as the first run made them.

        Args:
            step: the step's index.
            closure: forward and backward of the whole step; returns the step's loss (a 0-d
                tensor or a number). It may run again, so it must not fetch data itself, and
                the batch it captures must not be refilled in place while it may run.
            log_loss: log the returned loss as ``loss`` on recorded steps (False when the
                closure or the loop logs it).

        Returns:
            What the closure returned.
        """
        recorded = self.begin_step(step)
        begun = self._updates.begun
        try:
            out = closure()
            if log_loss and recorded and not self._closed:
                self.log("loss", out)
        except BaseException:
            self.abort_step()
            raise
        self.end_step()
        if self._replay is not None and self._updates.begun != begun:
            raise RuntimeError(f"Recorder.run: the closure of step {step} stepped the optimizer; with on_spike it runs "
                               "again on a spiking step, which would step it twice, and the watch would read the "
                               "gradients after the update. Call optimizer.step() and zero_grad() after rec.run returns "
                               "(the closure runs forward and backward only)")
        if self._replay is not None and not self._closed:
            self._replay.after(step, out, closure, recorded=recorded, log_loss=log_loss)
        return out

    def check_spike(self, step: int, loss: Any, rerun: Callable[[], Any], *, log_loss: bool = False) -> Reading:
        """The watch for callbacks that open steps with ``begin_step``/``end_step``: after
        ``end_step``, checks ``step``'s ``loss`` and gradient norm and replays it with
        ``rerun`` (forward and backward of the whole step again) when it spiked unrecorded.

        Raises:
            RuntimeError: the Recorder was made without ``on_spike``; a step is still open
                (call it after ``end_step``); the step was not opened with ``begin_step``.
        """
        if self._replay is None:
            raise RuntimeError("Recorder.check_spike: the Recorder was made without on_spike ('replay')")
        if self._session.step is not None:
            raise RuntimeError(f"Recorder.check_spike({step}): step {self._session.step} is still open; call check_spike "
                               "after end_step() (the replay opens the step again)")
        return self._replay.after(step, loss, rerun, recorded=self.records(step), log_loss=log_loss)

    @property
    def watch(self) -> SpikeWatch | None:
        """The spike watch (``watch.flagged``, ``watch.last``), or None without ``on_spike``."""
        return self._replay.watch if self._replay is not None else None

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The total gradient norm the watch took of the last step (0-d, on the device), for
        ``torch.nn.utils.clip_grads_with_norm_``; None without ``on_spike``. With a
        ``GradScaler`` it is divided by the scale: the norm after ``scaler.unscale_(opt)``."""
        return self._replay.grad_norm if self._replay is not None else None

    # -- the recorded table (recorded_table.py) ------------------------------------------
    def state_dict(self) -> dict:
        """Recorded rows, the sampling generator's state and the spike windows, as plain
        containers and tensors (loads with ``torch.load(weights_only=True)``). With
        ``log_dir`` the rows are on disk: the sinks are flushed first, so a checkpoint taken
        now loses no recorded step if the run is killed later, and the state holds no rows."""
        return self._table.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` saved (e.g. when resuming from a checkpoint);
        rows a Recorder kept in memory go to this one's ``log_dir`` if it has one."""
        self._table.load_state_dict(state)

    def frame(self, *, gather: bool = False, dst: int = 0, micro_steps: bool = False) -> pd.DataFrame | None:
        """Everything recorded so far as the tidy table (docs/table.md): one row per step and
        point, the step's value (under gradient accumulation, the accumulated step's).

        Args:
            gather: collect every rank's rows on rank ``dst``
                (:func:`gradscope.distributed.gather_frame`). Collective: every rank must
                call it; the other ranks get None.
            dst: the rank that receives the gathered table.
            micro_steps: also the rows of each micro-batch of an accumulated step
                (``micro_step`` 0, 1, ...; the step's own rows have ``micro_step`` −1).
        """
        return self._table.frame(gather=gather, dst=dst, micro_steps=micro_steps)

    def save(self, path, *, gather: bool = False, dst: int = 0) -> None:
        """Writes the table, micro-steps' rows included, to a parquet file atomically (see
        ``gradscope.io``; ``gradscope.load`` reads it back).

        With ``gather=True`` every rank must call it; rank ``dst`` writes all ranks' rows
        and the others write nothing.
        """
        self._table.save(path, gather=gather, dst=dst)

    def flush(self) -> None:
        """Writes what the sinks buffer (a part file for ``log_dir``, pending tracker rows) now."""
        self._table.flush()

    @property
    def rows_in_memory(self) -> int:
        """Rows kept in memory (none beyond a flush buffer with ``log_dir``)."""
        return self._table.rows_in_memory
