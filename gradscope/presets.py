"""Named presets, as functions (torchtune style): the one place that says how big things are.

Two kinds, one family:

- **Model sizes** return a :class:`~gradscope.ModelConfig` and take keyword overrides:
  ``presets.base(variant="b2t", n_enc=18, n_dec=18)``. :data:`SIZES` maps their names.
- **Run presets** ``ci()``, ``default()`` and ``paper()`` return a :class:`Preset`: a model
  size, the data and the training recipe together, as the analyses, notebooks and scan
  use them (docs/zoo.md, "Sizes and run presets"). :data:`PRESETS` maps their names; :func:`get` looks one up.

The training recipe is the papers' scaled down and the same for every run of a preset:
Adam β=(0.9, 0.98), ε=1e-8, peak lr 1e-3 with an inverse-sqrt schedule after a linear
warm-up of 8% of the steps (Takase 2022 Table 7: lr 1e-3, 4k warm-up of 50k updates), label
smoothing 0.1, loss in nats averaged over target tokens, on the built-in ``reverse`` seq2seq
task. At ``default`` and ``paper`` the task is closer to WMT than uniform tokens (issue 49): a
vocabulary much larger than the width, Zipfian content ids (the k-th id has probability
∝ 1/k) and one embedding matrix shared by source, target and output, as the papers' joint-BPE
setups share their vocabulary (Wang 2019 §4.1, Xu 2020 §4, Takase 2022 §4.1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gradscope.config import ModelConfig
from gradscope.train.config import TrainConfig
from gradscope.train.tasks import Task, make_task

# --- model sizes ------------------------------------------------------------------------------


def base(**overrides) -> ModelConfig:
    """The papers' base size: d=512, 8 heads, d_ff=2048, 6+6 layers, dropout 0.1 (Vaswani 2017)."""
    return ModelConfig(**{"d_model": 512, "n_heads": 8, "d_ff": 2048, "n_enc": 6, "n_dec": 6, "dropout": 0.1, **overrides})


def small(**overrides) -> ModelConfig:
    """A laptop size: d=128, 4 heads, d_ff=512, 6+6 layers, dropout 0.1."""
    return ModelConfig(**{"d_model": 128, "n_heads": 4, "d_ff": 512, "n_enc": 6, "n_dec": 6, "dropout": 0.1, "max_len": 128, **overrides})


def tiny(**overrides) -> ModelConfig:
    """A CI size: d=32, 2 heads, d_ff=64, 2+2 layers, vocab 64, dropout 0."""
    return ModelConfig(
        **{"d_model": 32, "n_heads": 2, "d_ff": 64, "n_enc": 2, "n_dec": 2, "vocab": 64, "dropout": 0.0, "max_len": 64, **overrides}
    )


SIZES: dict[str, Callable[..., ModelConfig]] = {"base": base, "small": small, "tiny": tiny}

# --- run presets ------------------------------------------------------------------------------

TASK = "reverse"


@dataclass(frozen=True, kw_only=True)
class Preset:
    """Model size, data and training recipe shared by every run at one preset.

    Attributes:
        name: ``ci``, ``default`` or ``paper``.
        size: the model every run starts from (width, heads, d_ff, dropout, vocab and
            max_len of the ``reverse`` task); runs set variant, init and depths.
        batch_size: sequences per step (training, snapshots and validation).
        deep: layers per stack of the deep setting (Takase's 18L-18L).
        shallow: layers per stack of the shallow setting (Takase's 6L-6L).
        lr: peak learning rate (Takase 2022 Table 7: 1e-3).
        warmup_fraction: warm-up steps as a fraction of a run's steps (4k / 50k = 0.08).
        eval_batches: validation batches per evaluation; 10 evaluations per run.
        seeds: seeds of each init-only run (cheap): a claim is decided over >= 3
            (``gradscope.claims.seeds``).
        train_seeds: seeds of each trained run. Fewer than 3 leave every trained claim
            inconclusive unless the analysis asks for more (``Analysis.min_train_seeds``).
        zipf: exponent of the ``reverse`` task's content-id frequencies (0: uniform).
    """

    name: str
    size: ModelConfig
    batch_size: int
    deep: int
    shallow: int
    lr: float = 1e-3
    warmup_fraction: float = 0.08
    eval_batches: int = 4
    seeds: int = 3
    train_seeds: int = 1
    zipf: float = 0.0

    def model(self, variant: str, n_enc: int, n_dec: int, **options: object) -> ModelConfig:
        """An encoder-decoder ``ModelConfig`` of this preset's size."""
        return self.size.replace(variant=variant, n_enc=n_enc, n_dec=n_dec, **options)

    def decoder(self, variant: str, depth: int, **options: object) -> ModelConfig:
        """A decoder-only ``ModelConfig`` of this preset's size (no second embedding to share)."""
        return self.size.replace(arch="decoder", variant=variant, n_enc=depth, n_dec=depth, share_embeddings=False,
                                 **options)

    def train(self, steps: int, *, seed: int = 0, device: str = "auto", lr: float | None = None,
              warmup: int | None = None, schedule: str = "inverse_sqrt") -> TrainConfig:
        """The recipe for a run of ``steps`` steps (warm-up ``warmup_fraction`` unless given)."""
        return TrainConfig(
            steps=steps, batch_size=self.batch_size, lr=self.lr if lr is None else lr,
            warmup=round(self.warmup_fraction * steps) if warmup is None else warmup, schedule=schedule,
            eval_every=max(1, steps // 10), eval_batches=self.eval_batches, seed=seed, device=device)

    def task(self, seed: int = 0) -> Task:
        """The built-in ``reverse`` seq2seq task at this preset's size and :attr:`zipf`."""
        return make_task(TASK, vocab=self.size.vocab, max_len=self.size.max_len, seed=seed, zipf=self.zipf)

    def describe(self, task: str = TASK) -> str:
        """One line for figure footers (``task``: the task the runs train on, default the preset's)."""
        m = self.size
        tokens = f"Zipf {self.zipf:g} ids" if task == TASK and self.zipf else ""
        shared = "shared embeddings" if m.share_embeddings and task == TASK else ""
        extra = "".join(f", {x}" for x in (tokens, shared) if x)
        return (f"preset {self.name}: d={m.d_model}, {m.n_heads} heads, d_ff={m.d_ff}, "
                f"dropout {m.dropout:g}; task {task} (vocab {m.vocab}, max_len {m.max_len}{extra}), "
                f"batch {self.batch_size}")


def ci() -> Preset:
    """The :func:`tiny` width, runs in CI on 2 CPU cores (minutes)."""
    return Preset(name="ci", size=tiny(vocab=32, max_len=10), batch_size=16, deep=6, shallow=2, eval_batches=2)


def default() -> Preset:
    """A laptop CPU: width 64 (d_ff = 4d as in the base model), the papers' depths; vocab 256
    (4 d) with Zipfian ids and shared embeddings."""
    return Preset(name="default", size=small(d_model=64, d_ff=256, vocab=256, max_len=12, share_embeddings=True),
                  batch_size=32, deep=18, shallow=6, eval_batches=4, zipf=1.0)


def paper() -> Preset:
    """The papers' size (:func:`base`: d=512, 8 heads, d_ff=2048, dropout 0.1), for a GPU."""
    return Preset(name="paper", size=base(vocab=8192, max_len=32, share_embeddings=True), batch_size=256, deep=18,
                  shallow=6, eval_batches=16, train_seeds=3, zipf=1.0)


PRESETS: dict[str, Callable[[], Preset]] = {"ci": ci, "default": default, "paper": paper}


def get(name: str) -> Preset:
    """The run preset called ``name`` (``ci``, ``default`` or ``paper``).

    Raises:
        ValueError: an unknown name, listing the valid ones.
    """
    if name not in PRESETS:
        raise ValueError(f"preset: unknown {name!r}; valid: {list(PRESETS)}")
    return PRESETS[name]()
