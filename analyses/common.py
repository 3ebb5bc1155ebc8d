"""Shared pieces of the analyses: presets, the command line, running, saving, annotating.

Every analysis follows the same path (STYLE §7): ``plan`` (the runs a preset asks for) →
``execute`` (build, record, train) → one tidy table → plot → save table and figure →
verdicts. This module holds what they share:

- :class:`Preset` and :data:`PRESETS`: model size, data and training recipe of the
  ``ci`` / ``default`` / ``paper`` presets. The recipe is the papers' scaled down and the
  same for every variant of an analysis: Adam β=(0.9, 0.98), ε=1e-8, peak lr 1e-3 with an
  inverse-sqrt schedule after a linear warm-up of 8% of the steps (Takase 2022 Table 7:
  lr 1e-3, 4k warm-up of 50k updates), label smoothing 0.1, loss in nats averaged over
  target tokens, on the built-in ``reverse`` seq2seq task.
- :func:`make_parser`: the flags every analysis takes.
- :class:`RunSpec` and :func:`execute`: one model, optionally trained, with recorded
  quantities at initialisation and during training.
- :func:`save_table`, :func:`save_figure`, :func:`annotate`, :func:`report`: outputs,
  each written atomically (temporary file + ``os.replace``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use(os.environ.get("MPLBACKEND") or "Agg")  # figures are only ever saved

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import gradscope  # noqa: E402
from gradscope.claims import Verdict, verdict_line, write_claims  # noqa: E402
from gradscope.io import atomic_write  # noqa: E402
from gradscope.table import COLUMNS, DTYPES  # noqa: E402
from gradscope.train import TrainConfig, label_smoothed_loss, make_task, resolve_device, train  # noqa: E402
from gradscope.train.tasks import Task  # noqa: E402

PRESET_NAMES: tuple[str, ...] = ("ci", "default", "paper")
TASK = "reverse"


@dataclass(frozen=True, kw_only=True)
class Preset:
    """Model size, data and training recipe shared by every analysis at one preset.

    Attributes:
        name: ``ci``, ``default`` or ``paper``.
        d_model, n_heads, d_ff, dropout: model width (same for every run of the preset).
        vocab, max_len: the ``reverse`` task's vocabulary and longest sequence.
        batch_size: sequences per step (training, snapshots and validation).
        deep: layers per stack of the deep setting (Takase's 18L-18L).
        shallow: layers per stack of the shallow setting (Takase's 6L-6L).
        lr: peak learning rate (Takase 2022 Table 7: 1e-3).
        warmup_fraction: warm-up steps as a fraction of a run's steps (4k / 50k = 0.08).
        eval_batches: validation batches per evaluation; 10 evaluations per run.
    """

    name: str
    d_model: int
    n_heads: int
    d_ff: int
    dropout: float
    vocab: int
    max_len: int
    batch_size: int
    deep: int
    shallow: int
    lr: float = 1e-3
    warmup_fraction: float = 0.08
    eval_batches: int = 4

    def model(self, variant: str, n_enc: int, n_dec: int, **options: object) -> gradscope.ModelConfig:
        """An encoder-decoder ``ModelConfig`` of this preset's width."""
        return gradscope.ModelConfig(
            variant=variant, n_enc=n_enc, n_dec=n_dec, d_model=self.d_model, n_heads=self.n_heads,
            d_ff=self.d_ff, dropout=self.dropout, vocab=self.vocab, max_len=self.max_len, **options)

    def train(self, steps: int, *, seed: int = 0, device: str = "auto", lr: float | None = None,
              warmup: int | None = None, schedule: str = "inverse_sqrt") -> TrainConfig:
        """The recipe for a run of ``steps`` steps (warm-up ``warmup_fraction`` unless given)."""
        return TrainConfig(
            steps=steps, batch_size=self.batch_size, lr=self.lr if lr is None else lr,
            warmup=round(self.warmup_fraction * steps) if warmup is None else warmup, schedule=schedule,
            eval_every=max(1, steps // 10), eval_batches=self.eval_batches, seed=seed, device=device)

    def task(self, seed: int = 0) -> Task:
        """The built-in ``reverse`` seq2seq task at this preset's size."""
        return make_task(TASK, vocab=self.vocab, max_len=self.max_len, seed=seed)

    def describe(self) -> str:
        """One line for figure footers."""
        return (f"preset {self.name}: d={self.d_model}, {self.n_heads} heads, d_ff={self.d_ff}, "
                f"dropout {self.dropout:g}; task {TASK} (vocab {self.vocab}, max_len {self.max_len}), "
                f"batch {self.batch_size}")


PRESETS: dict[str, Preset] = {
    # gradscope.presets.tiny's width; runs in CI on 2 CPU cores.
    "ci": Preset(name="ci", d_model=32, n_heads=2, d_ff=64, dropout=0.0, vocab=32, max_len=10, batch_size=16,
                 deep=6, shallow=2, eval_batches=2),
    # A laptop CPU: width 64 (d_ff = 4d as in the base model), the papers' depths.
    "default": Preset(name="default", d_model=64, n_heads=4, d_ff=256, dropout=0.1, vocab=32, max_len=12,
                      batch_size=32, deep=18, shallow=6, eval_batches=4),
    # The papers' size (Vaswani base: d=512, 8 heads, d_ff=2048, dropout 0.1), for a GPU.
    "paper": Preset(name="paper", d_model=512, n_heads=8, d_ff=2048, dropout=0.1, vocab=64, max_len=32,
                    batch_size=256, deep=18, shallow=6, eval_batches=16),
}


def recipe_text(config: TrainConfig) -> str:
    """The training recipe in one line, for figure footers."""
    warm = f"{config.warmup}-step linear warm-up, " if config.warmup else "no warm-up, "
    return (f"{config.steps} steps, Adam β=({config.betas[0]:g}, {config.betas[1]:g}), peak lr {config.lr:g}, "
            f"{warm}{config.schedule} schedule, label smoothing {config.label_smoothing:g}, "
            f"loss in nats (mean over target tokens), seed {config.seed}")


# --- command line ---------------------------------------------------------------------------

def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The flags every analysis takes (``python -m analyses.<name> --help``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESET_NAMES, default="default",
                        help="model size and training length: ci (minutes on 2 CPU cores), default (a laptop), "
                             "paper (the papers' sizes, for a GPU); default: %(default)s")
    parser.add_argument("--out", type=Path, default=Path("figures"),
                        help="directory for the figure (PNG, PDF), table (parquet) and CLAIMS.md; "
                             "default: %(default)s")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to run: cuda when available with auto; default: %(default)s")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of model init, data and dropout; default: %(default)s")
    parser.add_argument("--threads", type=_positive_int, default=1,
                        help="torch CPU threads; 1 is fastest for these small models on a shared 2-core "
                             "machine; default: %(default)s")
    parser.add_argument("--max-steps", type=_positive_int, default=None,
                        help="cap every training run at this many steps (smoke tests); the figures say so")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the planned runs and build each model once, then exit without training "
                             "or writing anything")
    parser.add_argument("--no-progress", action="store_true", help="hide the per-run tqdm bars")
    return parser


def parse_args(prog: str, description: str, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses ``argv`` with :func:`make_parser`; ``--device cuda`` without CUDA is a usage error."""
    parser = make_parser(prog, description)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    return args


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


@dataclass(frozen=True)
class Settings:
    """What a training analysis runs at one preset: ``depth`` layers per stack, ``steps`` training steps."""

    preset: Preset
    depth: int
    steps: int


# --- running ------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunSpec:
    """One model of an analysis: its run name, configuration and training (None: init only)."""

    run: str
    model: gradscope.ModelConfig
    train: TrainConfig | None = None

    @property
    def init(self) -> str:
        """The model's weight init (the table has no init column)."""
        return self.model.init

    @property
    def depth(self) -> int:
        """Encoder layers N (the depth of a sweep)."""
        return self.model.n_enc


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


def measure(model: torch.nn.Module, task: Task, *, run: str, quantities: Sequence[str], step: int,
            split: str = "train", index: int = 1, batch_size: int, device: torch.device, seed: int = 0,
            eval_mode: bool = False) -> pd.DataFrame:
    """``gradscope.snapshot`` of one batch (``task.batch(split, index)``) labelled ``step``.

    The model keeps its mode unless ``eval_mode`` (no dropout) is asked; dropout is seeded.
    """
    batch = tuple(t.to(device) for t in task.batch(split, index, batch_size))
    was_training = model.training
    model.train(not eval_mode and was_training)
    torch.manual_seed(seed)
    try:
        return gradscope.snapshot(model, task.model_inputs(batch), loss_for(task, task.targets(batch)),
                                  quantities=list(quantities), run=run, step=step)
    finally:
        model.train(was_training)


class _StepOnly:
    """Hands ``gradscope.train`` only the recorder's ``step`` context.

    ``train`` would also ``log`` the loss and lr into the recorder; they are in the training
    history already, which is concatenated with the recorded rows, so they are not logged twice.
    """

    def __init__(self, recorder: gradscope.Recorder) -> None:
        self.step = recorder.step


def execute(spec: RunSpec, task: Task, *, batch_size: int, seed: int, device: torch.device, progress: bool,
            quantities: Sequence[str] = (), record_every: int = 0
            ) -> tuple[torch.nn.Module, pd.DataFrame, bool]:
    """Builds, records at init and trains one run.

    Args:
        spec: the run.
        task: its data.
        batch_size: batch of the step-0 snapshot (training uses the spec's own).
        seed: init / data / dropout seed.
        device: where to run.
        progress: tqdm bar while training.
        quantities: recorded at step 0 on training batch 1 (before any update) and, when
            ``record_every`` > 0, every ``record_every`` training steps.
        record_every: recording interval during training (0: only at init).

    Returns:
        The model, its tidy table (snapshot rows, training history, recorded rows) and
        whether the training loss went non-finite.
    """
    model = build(spec, seed, device)
    parts: list[pd.DataFrame] = []
    if quantities:
        parts.append(measure(model, task, run=spec.run, quantities=quantities, step=0,
                             batch_size=batch_size, device=device, seed=seed))
    diverged = False
    if spec.train is not None:
        recorder = None
        if quantities and record_every:
            recorder = gradscope.Recorder(model, quantities=list(quantities), every=record_every, slow_every=1,
                                          run=spec.run)
        try:
            result = train(model, task, spec.train, recorder=_StepOnly(recorder) if recorder else None,
                           progress=progress, run=spec.run, variant=spec.model.variant)
        finally:
            if recorder is not None:
                recorder.close()
        parts.append(result.history)
        if recorder is not None:
            parts.append(recorder.frame())
        diverged = result.diverged
    return model, concat(parts), diverged


def concat(parts: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Tidy tables stacked into one, with the canonical columns and dtypes."""
    parts = [p[list(COLUMNS)] for p in parts if len(p)]
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in DTYPES.items()})
    return pd.concat(parts, ignore_index=True).astype(DTYPES)


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
        plan = recipe_text(t) if t else "init only"
        print(f"[dry-run] {spec.run}: {size}, {built[spec.model] / 1e6:.2f}M parameters, one forward/backward ran; {plan}")


@dataclass(frozen=True)
class Context:
    """What an analysis's ``collect`` gets: the task, the device, and ``train(spec, **kw)``,
    :func:`execute` with this run's batch size, seed, device and progress flag bound."""

    task: Task
    device: torch.device
    batch_size: int
    seed: int
    progress: bool

    def train(self, spec: RunSpec, **kwargs) -> tuple[torch.nn.Module, pd.DataFrame, bool]:
        """:func:`execute` of ``spec``; ``kwargs`` (``quantities``, ``record_every``,
        ``progress``) go to it."""
        kwargs = {"batch_size": self.batch_size, "seed": self.seed, "device": self.device, "progress": self.progress, **kwargs}
        return execute(spec, self.task, **kwargs)


def run_analysis(args: argparse.Namespace, name: str, preset: Preset, specs: Sequence[RunSpec],
                 collect: Callable[[RunSpec, Context], Sequence[pd.DataFrame]],
                 conclude: Callable[[pd.DataFrame], tuple[Figure, list[Verdict]]]) -> list[Verdict]:
    """The path every figure analysis shares: open a session; on ``--dry-run`` build each model
    and stop; otherwise gather ``collect(spec, context)`` over the runs into one table, let
    ``conclude(table)`` draw the figure and judge the claims, and publish both.

    Returns:
        The verdicts (empty on a dry run).
    """
    with session(args, name) as device:
        task = preset.task(args.seed)
        if args.dry_run:
            dry_run(specs, task, device)
            return []
        context = Context(task=task, device=device, batch_size=preset.batch_size, seed=args.seed,
                          progress=not args.no_progress)
        df = concat([table for spec in specs for table in collect(spec, context)])
        fig, found = conclude(df)
        publish(df, fig, found, args.out, name)
    return found


# --- outputs ------------------------------------------------------------------------------

def save_table(df: pd.DataFrame, out: Path, name: str) -> Path:
    """The tidy table as ``out/<name>.parquet`` (``gradscope.save_frame``, atomic)."""
    return gradscope.save_frame(df, out / f"{name}.parquet")


def save_plain_table(df: pd.DataFrame, out: Path, name: str) -> Path:
    """A table that is not a gradscope table (a sweep summary) as parquet, atomically."""
    return atomic_write(out / f"{name}.parquet", lambda tmp: df.to_parquet(tmp, index=False))


def save_figure(fig: Figure, out: Path, name: str) -> list[Path]:
    """``out/<name>.png`` (150 dpi) and ``out/<name>.pdf``, each atomic; closes the figure."""
    paths = []
    for fmt, extra in (("png", {"dpi": 150}), ("pdf", {})):
        write = lambda tmp, f=fmt, kw=extra: fig.savefig(tmp, format=f, bbox_inches="tight", **kw)  # noqa: E731
        paths.append(atomic_write(out / f"{name}.{fmt}", write))
    plt.close(fig)
    return paths


def annotate(fig: Figure, title: str, lines: Sequence[str], verdicts: Sequence[Verdict] = ()) -> None:
    """Figure title, and a footer with the preset, the recipe and every verdict.

    A claim that does not show at this preset is written on the figure as such.
    """
    fig.suptitle(title, fontsize="large")
    footer = [*lines, *(f"[{v.status}] {v.figure}: {v.claim}" for v in verdicts)]
    fig.text(0.01, -0.01, "\n".join(footer), ha="left", va="top", fontsize="small", wrap=True)


def publish(df: pd.DataFrame, fig: Figure, verdicts: Sequence[Verdict], out: Path, name: str) -> None:
    """Saves ``name``'s table and figure into ``out``, prints its verdicts and updates CLAIMS.md."""
    save_table(df, out, name)
    save_figure(fig, out, name)
    report(verdicts, out, name)


def entry_point(name: str, description: str, run: Callable[[argparse.Namespace], object]) -> Callable[..., int]:
    """The ``main(argv=None)`` of ``python -m analyses.<name>``: parse the shared flags, run, exit 0."""

    def main(argv: Sequence[str] | None = None) -> int:
        run(parse_args(f"python -m analyses.{name}", description, argv))
        return 0

    main.__doc__ = f"Runs ``python -m analyses.{name}`` with ``argv`` (default: sys.argv)."
    return main


def report(verdicts: Sequence[Verdict], out: Path, analysis: str) -> None:
    """Prints one line per verdict and updates ``out/CLAIMS.md``'s section of ``analysis``."""
    for v in verdicts:
        print(verdict_line(v), flush=True)
    write_claims(verdicts, out / "CLAIMS.md", analysis=analysis)


def tag(v: Verdict, setting: str) -> Verdict:
    """``v`` with its setting (``18L-18L``, ``at init``...) appended to the claim."""
    return dataclasses.replace(v, claim=f"{v.claim} ({setting})")


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
