"""An analysis is a small protocol; :func:`run` drives every one the same way (STYLE §7).

An :class:`Analysis` says what it **plans** (the runs of a preset), what it **collects**
from each run (tidy tables), what it **concludes** from the whole table (verdicts on the
papers' claims) and what it **draws** (one figure). :func:`run` opens a session (threads,
device, ``--out``), stops after building each model on ``--dry-run``, and otherwise
collects, concludes, draws and publishes the table, figure and ``CLAIMS.md``;
:func:`entry_point` makes the ``main(argv=None)`` of ``python -m analyses.<name>``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from pathlib import Path
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

import pandas as pd
import torch
from matplotlib.figure import Figure

from analyses.cli import parse_args
from analyses.outputs import annotate, publish, report, save_figure, save_plain_table, saved_setting
from analyses.runs import Bench, RunSpec, TrainRequest, cap_steps, dry_run
from analyses.workers import collect_runs
from gradscope import presets
from gradscope.claims import Verdict, seed_run, split_run
from gradscope.io import load
from gradscope.table import concat
from gradscope.train import resolve_device


class Analysis:
    """One figure of docs/papers.md at one preset.

    Subclasses set :attr:`name` and define :meth:`plan`, :meth:`conclude` and :meth:`draw`;
    the default :meth:`collect` trains each planned run (or only builds it, for an init-only
    run), recording :attr:`quantities` at step 0 and :attr:`recordings` times during training.

    Args:
        preset: ``ci``, ``default`` or ``paper`` (or a :class:`gradscope.presets.Preset`).
        seed: init / data / dropout seed of every run.
        device: ``auto``, ``cpu`` or ``cuda``, for the training configs.
        max_steps: cap on every run's training steps (smoke tests), or None.
        batch_size: sequences per batch instead of the preset's (``--batch-size``), or None;
            the figure footer and every verdict's detail say so.
        init_only: skip training (``--init-only``): :meth:`trained` plans an init-only run,
            and an analysis that trains concludes and draws only its at-init part.
    """

    name: ClassVar[str]
    #: whether the analysis has an at-init part that stands alone (``--init-only`` allowed)
    at_init: ClassVar[bool] = False
    quantities: ClassVar[tuple[str, ...]] = ()
    #: the task its runs train on, for the footer (an analysis that overrides :meth:`task` names its own)
    task_name: ClassVar[str] = presets.TASK
    recordings: ClassVar[int] = 0
    #: whether its runs may go to worker processes (``--workers``): :meth:`collect` keeps
    #: nothing on the analysis, everything it makes is in the tables it returns
    runs_apart: ClassVar[bool] = True
    #: trained seeds at least, whatever the preset's (an analysis cheap enough to decide its
    #: comparison over >= 3 seeds at every preset; issue 49)
    min_train_seeds: ClassVar[int] = 1

    def __init__(self, preset: str | presets.Preset, *, seed: int = 0, device: str = "auto",
                 max_steps: int | None = None, batch_size: int | None = None, init_only: bool = False) -> None:
        preset = presets.get(preset) if isinstance(preset, str) else preset
        self.preset_batch_size = preset.batch_size
        if batch_size is not None and batch_size != preset.batch_size:
            preset = dataclasses.replace(preset, batch_size=batch_size)
        self.preset = preset
        self.seed, self.device, self.max_steps, self.init_only = seed, device, max_steps, init_only

    # -- the protocol ------------------------------------------------------------------------
    def plan(self) -> list[RunSpec]:
        """The runs, in order (their names are the table's ``run`` column)."""
        raise NotImplementedError

    def collect(self, spec: RunSpec, bench: Bench) -> list[pd.DataFrame]:
        """The tables of one run: by default those of :meth:`request`. An analysis that
        overrides this method runs its own way, and ``python -m analyses`` does not share its
        runs with other analyses (:mod:`analyses.pool`)."""
        return bench.run(self.request(spec))

    def request(self, spec: RunSpec) -> TrainRequest:
        """What the default :meth:`collect` records of ``spec``: :meth:`quantities_for` at step 0
        and :attr:`recordings` times during training."""
        steps = spec.train.steps if spec.train is not None else 0
        every = max(1, steps // self.recordings) if self.recordings and steps else 0
        return TrainRequest(spec, self.quantities_for(spec), every)

    def conclude(self, table: pd.DataFrame) -> list[Verdict]:
        """The verdicts on the papers' claims, each tagged with its setting."""
        raise NotImplementedError

    def draw(self, table: pd.DataFrame, verdicts: Sequence[Verdict]) -> Figure:
        """The figure, with the preset, recipe and verdicts written on it."""
        raise NotImplementedError

    def task(self, seed: int):
        """The task every run trains on (default: the preset's ``reverse`` task)."""
        return self.preset.task(seed)

    def extra_tables(self, table: pd.DataFrame) -> dict[str, pd.DataFrame]:
        """Further tables to save beside the tidy one, by file name (default: none)."""
        return {}

    def restore(self, out: Path) -> None:
        """``--redraw``: reads back from ``out`` what :meth:`collect` kept besides the tidy
        table (default: nothing)."""

    # -- helpers for subclasses ---------------------------------------------------------------
    def quantities_for(self, spec: RunSpec) -> tuple[str, ...]:
        """What the default :meth:`collect` records of ``spec`` (default: :attr:`quantities`)."""
        return self.quantities

    def run_setting(self) -> dict:
        """What the table depends on besides the code: preset, seed and the flags that change
        runs (recorded in the saved table; ``--redraw`` checks it)."""
        return {"preset": self.preset.name, "seed": self.seed, "max_steps": self.max_steps,
                "batch_size": self.preset.batch_size, "init_only": self.init_only}

    @property
    def batch_reduced(self) -> bool:
        """Whether ``--batch-size`` changed the preset's batch."""
        return self.preset.batch_size != self.preset_batch_size

    def setting_notes(self) -> list[str]:
        """What differs from the preset (``--max-steps``, ``--batch-size``, ``--init-only``), for
        footers and verdicts."""
        notes = []
        if self.max_steps is not None:
            notes.append(f"training capped at {self.max_steps} step{'s' if self.max_steps != 1 else ''} "
                         "(--max-steps: a smoke run, not the preset's verdict)")
        if self.batch_reduced:
            notes.append(f"batch {self.preset.batch_size} instead of the preset's {self.preset_batch_size} "
                         "(--batch-size; width and depth unchanged)")
        if self.init_only:
            notes.append("at-init part only (--init-only): no training")
        return notes

    def noted(self, verdicts: Sequence[Verdict]) -> list[Verdict]:
        """``verdicts`` with :meth:`setting_notes` prepended to each detail."""
        notes = "; ".join(self.setting_notes())
        if not notes:
            return list(verdicts)
        return [dataclasses.replace(v, detail=f"{notes}; {v.detail}" if v.detail else notes) for v in verdicts]

    def trained(self, run: str, model, steps: int, *, k: int = 0, **recipe) -> RunSpec:
        """A run trained ``steps`` steps with the preset's recipe (``recipe``: lr, warmup,
        schedule overrides), capped at ``max_steps``; init only with ``init_only``. ``k``: the
        seed index (seed ``self.seed + k``, run name ``claims.seed_run(run, k)``)."""
        if self.init_only:
            return self.init_run(run, model, k=k)
        config = self.preset.train(steps, seed=self.seed + k, device=self.device, **recipe)
        return cap_steps(RunSpec(seed_run(run, k), model, config, seed=self.seed + k), self.max_steps)

    def init_run(self, run: str, model, *, k: int = 0) -> RunSpec:
        """An init-only run at seed index ``k`` (seed ``self.seed + k``)."""
        return RunSpec(seed_run(run, k), model, seed=self.seed + k)

    def seed_indices(self, trained: bool) -> range:
        """Seed indices of the runs: ``preset.train_seeds`` of them for trained runs (at least
        :attr:`min_train_seeds`), ``preset.seeds`` for init-only ones (cheap)."""
        if trained and not self.init_only:
            return range(max(self.preset.train_seeds, self.min_train_seeds))
        return range(self.preset.seeds)

    @staticmethod
    def first_seed(df: pd.DataFrame) -> pd.DataFrame:
        """The rows of seed index 0 (the runs the figures draw)."""
        return df.loc[df["run"].map(lambda r: split_run(str(r))[1] == 0)]

    def annotate(self, fig: Figure, title: str, lines: Sequence[str], verdicts: Sequence[Verdict]) -> Figure:
        """:func:`analyses.outputs.annotate` with the preset's line first."""
        describe = self.preset.describe(self.task_name)
        if self.batch_reduced:
            describe += f" (reduced from the preset's {self.preset_batch_size} with --batch-size)"
        notes = ["at-init part only (--init-only): no training"] if self.init_only else []
        annotate(fig, title, [describe, *notes, *lines], verdicts)
        return fig


@contextlib.contextmanager
def session(args: argparse.Namespace, name: str) -> Iterator[torch.device]:
    """Sets torch's CPU threads (restored on exit), resolves the device, creates ``--out``
    and prints the analysis's wall time."""
    device = resolve_device(args.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if not args.dry_run:
            args.out.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        yield device
        print(f"{name}: {time.perf_counter() - start:.1f} s (preset {args.preset}, device {device})", flush=True)
    finally:
        torch.set_num_threads(threads)


def run(kind: type[Analysis], args: argparse.Namespace) -> list[Verdict]:
    """Runs the analysis ``kind`` with the command line ``args``.

    Returns:
        The verdicts (empty on a dry run).

    Raises:
        SystemExit: ``--init-only`` for an analysis without a standalone at-init part.
    """
    if args.init_only and not kind.at_init:
        raise SystemExit(f"{kind.name}: --init-only is not supported (its claims need training)")
    analysis = kind(args.preset, seed=args.seed, device=args.device, max_steps=args.max_steps,
                    batch_size=args.batch_size, init_only=args.init_only)
    specs = analysis.plan()
    if getattr(args, "redraw", False):
        return redraw(analysis, specs, args)
    with session(args, kind.name) as device:
        task = analysis.task(args.seed)
        if args.dry_run:
            dry_run(specs, task, device)
            return []
        bench = Bench(task=task, device=device, batch_size=analysis.preset.batch_size, seed=args.seed,
                      progress=not args.no_progress)
        parts = collect_runs(analysis, specs, bench, workers=args.workers, threads=args.threads,
                             progress=not args.no_progress)
        return finish(analysis, parts, args)


def finish(analysis: Analysis, parts: Sequence[pd.DataFrame], args: argparse.Namespace) -> list[Verdict]:
    """Concludes, draws and publishes ``analysis`` from the tables of its runs (in its plan's
    order): the tidy table, its further tables, the figure and its CLAIMS.md section in ``--out``.

    Returns:
        The verdicts.
    """
    table = concat(parts)
    verdicts = analysis.noted(analysis.conclude(table))
    for name, extra in analysis.extra_tables(table).items():
        save_plain_table(extra, args.out, name)
    publish(table, analysis.draw(table, verdicts), verdicts, args.out, type(analysis).name, analysis.run_setting())
    return verdicts


def redraw(analysis: Analysis, specs: Sequence[RunSpec], args: argparse.Namespace) -> list[Verdict]:
    """``--redraw``: the verdicts, figure and further tables again from the table a run saved in
    ``--out`` (the table itself is not written).

    Raises:
        SystemExit: no table there, or one whose runs are not those the preset plans (another
            preset or depth: the footer would name the wrong one).
    """
    name = type(analysis).name
    path = args.out / f"{name}.parquet"
    if not path.exists():
        raise SystemExit(f"{name}: --redraw needs the table {path}; run the analysis without --redraw first")
    table, saved, now = load(path), saved_setting(path), analysis.run_setting()
    if saved is not None and saved != now:
        differ = ", ".join(f"{k} {saved.get(k)!r} there, {now.get(k)!r} now" for k in sorted(set(saved) | set(now))
                           if saved.get(k) != now.get(k))
        raise SystemExit(f"{name}: --redraw: {path} was made with another setting ({differ}); "
                         "pass the --preset and flags that table was made with")
    planned, found = [spec.run for spec in specs], set(table.run.unique())
    if set(planned) != found:  # (a table saved without its setting: its runs at least must be the plan's)
        raise SystemExit(f"{name}: --redraw: {path} holds the runs {sorted(found)}, while --preset {args.preset} "
                         f"plans {planned}; pass the --preset and flags that table was made with")
    analysis.restore(args.out)
    verdicts = analysis.noted(analysis.conclude(table))
    for extra_name, extra in analysis.extra_tables(table).items():
        save_plain_table(extra, args.out, extra_name)
    save_figure(analysis.draw(table, verdicts), args.out, name)
    report(verdicts, args.out, name)
    return verdicts


def entry_point(description: str, target: type[Analysis] | Callable[[argparse.Namespace], object],
                name: str | None = None) -> Callable[..., int]:
    """The ``main(argv=None)`` of ``python -m analyses.<name>``: parse the shared flags, run
    ``target`` (an :class:`Analysis` class, or a function of the arguments), exit 0."""
    if isinstance(target, type) and issubclass(target, Analysis):
        name, kind = target.name, target
        target = lambda args: run(kind, args)  # noqa: E731
    assert name is not None, "name= is needed for a function target"

    def main(argv: Sequence[str] | None = None) -> int:
        target(parse_args(f"python -m analyses.{name}", description, argv))
        return 0

    main.__doc__ = f"Runs ``python -m analyses.{name}`` with ``argv`` (default: sys.argv)."
    return main
