"""Running the models of an analysis: what a run is, and the bench that builds, records and trains it.

- :class:`RunSpec`: one model of an analysis, optionally trained.
- :class:`TrainRequest`: what an analysis records of a run it only trains (and the
  :class:`Snapshot` it takes of the trained model): the unit ``python -m analyses`` shares
  between analyses (:mod:`analyses.pool`).
- :class:`Bench`: what an analysis's ``collect`` gets: the task, the device, the seed and
  :meth:`Bench.train` / :meth:`Bench.measure`.
- :func:`dry_run`: build each planned model once, print the plan, train nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

import gradscope
from gradscope.table import concat
from gradscope.train import TrainConfig, label_smoothed_loss, train
from gradscope.train.tasks import Task


@dataclass(frozen=True)
class RunSpec:
    """One model of an analysis: its run name, configuration, training (None: init only) and
    seed of init, data order and dropout (None: the bench's)."""

    run: str
    model: gradscope.ModelConfig
    train: TrainConfig | None = None
    seed: int | None = None

    @property
    def init(self) -> str:
        """The model's weight init (the table has no init column)."""
        return self.model.init

    @property
    def depth(self) -> int:
        """Encoder layers N (the depth of a sweep)."""
        return self.model.n_enc


@dataclass(frozen=True)
class Snapshot:
    """A measurement of a run's trained model (:meth:`Bench.measure`, labelled with the run's
    last step): ``quantities`` on batch ``index`` of ``split``, in eval mode (no dropout) or not."""

    quantities: tuple[str, ...]
    split: str = "valid"
    index: int = 0
    eval_mode: bool = True


@dataclass(frozen=True)
class TrainRequest:
    """What an analysis wants of one run that it builds, records and trains the standard way.

    Attributes:
        spec: the run.
        quantities: recorded at step 0 and every ``record_every`` training steps (none: the
            training loop's rows alone, :data:`gradscope.train.history.LOOP_QUANTITIES`).
        record_every: recording interval during training (0: at step 0 only).
        after: snapshots of the trained model, in order.
    """

    spec: RunSpec
    quantities: tuple[str, ...] = ()
    record_every: int = 0
    after: tuple[Snapshot, ...] = ()


def cap_steps(spec: RunSpec, max_steps: int | None) -> RunSpec:
    """``spec`` with its training capped at ``max_steps`` (warm-up and evaluation rescaled)."""
    if spec.train is None or max_steps is None or spec.train.steps <= max_steps:
        return spec
    t = spec.train
    cfg = t.replace(steps=max_steps, warmup=min(t.warmup, round(t.warmup * max_steps / t.steps)),
                    eval_every=max(1, max_steps // 10))
    return dataclasses.replace(spec, train=cfg)


def loss_for(task: Task, targets: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``logits -> loss`` against fixed ``targets`` (the training loss, for ``gradscope.snapshot``)."""
    return lambda logits: label_smoothed_loss(logits, targets, pad_id=task.pad_id, smoothing=0.1)


def build(spec: RunSpec, seed: int, device: torch.device) -> torch.nn.Module:
    """The spec's model, initialised from ``seed`` (every run of an analysis starts alike)."""
    torch.manual_seed(seed)
    return gradscope.build_model(spec.model).to(device)


@dataclass(frozen=True)
class Trained:
    """One run after :meth:`Bench.train`: the model, its tidy table, whether its loss went non-finite."""

    model: torch.nn.Module
    table: pd.DataFrame
    diverged: bool
    #: the training run's own rows (``table`` without the step-0 snapshot)
    training_rows: pd.DataFrame | None = None


@dataclass(frozen=True)
class Bench:
    """Where an analysis's runs are built, recorded and trained: the task, the device, the
    batch size of snapshots, the seed of init / data / dropout, and the progress bar flag."""

    task: Task
    device: torch.device
    batch_size: int
    seed: int
    progress: bool

    def seed_of(self, spec: RunSpec) -> int:
        """The spec's seed, or the bench's."""
        return self.seed if spec.seed is None else spec.seed

    def measure(self, model: torch.nn.Module, *, run: str, quantities: Sequence[str], step: int,
                split: str = "train", index: int = 1, eval_mode: bool = False, seed: int | None = None
                ) -> pd.DataFrame:
        """``gradscope.snapshot`` of one batch (``task.batch(split, index)``) labelled ``step``.

        The model keeps its mode unless ``eval_mode`` (no dropout) is asked; dropout is seeded
        (``seed``, default the bench's).
        """
        batch = tuple(t.to(self.device) for t in self.task.batch(split, index, self.batch_size))
        was_training = model.training
        model.train(not eval_mode and was_training)
        torch.manual_seed(self.seed if seed is None else seed)
        try:
            return gradscope.snapshot(model, self.task.model_inputs(batch), loss_for(self.task, self.task.targets(batch)),
                                      quantities=list(quantities), run=run, step=step)
        finally:
            model.train(was_training)

    def run(self, request: TrainRequest) -> list[pd.DataFrame]:
        """The tables of ``request``: its training table, then one per snapshot of the trained model."""
        spec = request.spec
        trained = self.train(spec, quantities=request.quantities, record_every=request.record_every)
        return [trained.table, *self.snapshots(trained.model, spec, request.after)]

    def snapshots(self, model: torch.nn.Module, spec: RunSpec, after: Sequence[Snapshot]) -> list[pd.DataFrame]:
        """:meth:`measure` of ``model`` for each of ``after``, labelled ``spec.run`` and its last step."""
        step = spec.train.steps if spec.train is not None else 0
        return [self.measure(model, run=spec.run, quantities=s.quantities, step=step, split=s.split, index=s.index,
                             eval_mode=s.eval_mode) for s in after]

    def train(self, spec: RunSpec, *, quantities: Sequence[str] = (), record_every: int = 0) -> Trained:
        """Builds, records at init and trains one run.

        Args:
            spec: the run (init only when ``spec.train`` is None).
            quantities: recorded at step 0 on training batch 1 (before any update) and, when
                ``record_every`` > 0, every ``record_every`` training steps.
            record_every: recording interval during training (0: only at init).

        Returns:
            The model, its tidy table (the step-0 snapshot, then the training run's store:
            recorded quantities with loss, lr and val_loss) and whether the loss went non-finite.
        """
        seed = self.seed_of(spec)
        model = build(spec, seed, self.device)
        parts: list[pd.DataFrame] = []
        if quantities:
            parts.append(self.measure(model, run=spec.run, quantities=quantities, step=0, seed=seed))
        diverged, training_rows = False, None
        if spec.train is not None:
            recorder = None
            if quantities and record_every:
                recorder = gradscope.Recorder(model, quantities=list(quantities), every=record_every, slow_every=1,
                                              run=spec.run)
            try:
                result = train(model, self.task, spec.train, recorder=recorder, progress=self.progress, run=spec.run,
                               variant=spec.model.variant)
            finally:
                if recorder is not None:
                    recorder.close()
            training_rows = result.store.frame()
            parts.append(training_rows)
            diverged = result.diverged
        return Trained(model, concat(parts), diverged, training_rows)


def dry_run(specs: Sequence[RunSpec], task: Task, device: torch.device) -> None:
    """Prints every planned run; builds each distinct model once and runs one forward/backward
    on a 2-sequence batch of ``task`` (no training, nothing written)."""
    built: dict[gradscope.ModelConfig, int] = {}
    batch = tuple(t.to(device) for t in task.batch("train", 1, 2))
    for spec in specs:
        if spec.model not in built:
            model = build(spec, 0, device)
            loss_for(task, task.targets(batch))(model(*task.model_inputs(batch))).backward()
            built[spec.model] = sum(p.numel() for p in model.parameters())
            del model
        m, t = spec.model, spec.train
        size = f"{m.variant}+{m.init} {m.n_enc}L-{m.n_dec}L d={m.d_model} h={m.n_heads} d_ff={m.d_ff}"
        plan = t.describe() if t else "init only"
        print(f"[dry-run] {spec.run}: {size}, {built[spec.model] / 1e6:.2f}M parameters, one forward/backward ran; {plan}")
