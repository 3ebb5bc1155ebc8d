"""Training configuration: one frozen keyword-only dataclass (named presets: ``gradscope.presets``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

SCHEDULES: tuple[str, ...] = ("inverse_sqrt", "constant")
DEVICES: tuple[str, ...] = ("cpu", "cuda", "auto")

# Fields that change the training trajectory: a checkpoint written under different values
# cannot be resumed bit-identically, so ``train`` refuses to resume across them.
TRAJECTORY_FIELDS: tuple[str, ...] = (
    "batch_size", "lr", "warmup", "schedule", "betas", "eps", "weight_decay", "label_smoothing", "clip_norm", "seed",
    "z_loss",
)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train: the papers' recipe, scaled down (docs/papers.md).

    Adam(β=(0.9, 0.98), ε=1e-8, as Wang et al. 2019 §4.1 and fairseq), inverse-sqrt
    schedule with linear warm-up, label smoothing 0.1. The loss is the cross entropy in
    nats (natural log), averaged over non-pad target tokens.

    Attributes:
        steps: total optimizer steps (a resumed run continues up to this step).
        batch_size: sequences per step.
        lr: peak learning rate.
        warmup: warm-up steps; 0 means no warm-up (peak at step 1, then inverse-sqrt decay
            for ``schedule="inverse_sqrt"``).
        schedule: ``"inverse_sqrt"`` (fairseq: ``lr * min(s / warmup, sqrt(warmup / s))``)
            or ``"constant"`` (linear warm-up to ``lr``, then flat).
        betas: Adam betas.
        eps: Adam epsilon (1e-8; Vaswani et al. 2017 used 1e-9).
        weight_decay: Adam's L2 weight decay (``torch.optim.Adam``, not AdamW).
        label_smoothing: ε of the label-smoothed cross entropy (torch semantics: ε/V on
            every class).
        clip_norm: max global gradient norm, or None for no clipping.
        z_loss: coefficient of the auxiliary z-loss, ``z_loss · mean over tokens of
            (log Z)²`` with log Z the logsumexp of the output logits (PaLM; Wortsman et al.
            2023 §3.2 use 1e-4); 0 (default) turns it off. The logged ``loss`` stays the
            cross entropy, so runs with and without it compare.
        eval_every: validation every this many steps (multiples of it); 0 disables.
        eval_batches: validation batches per evaluation (always the same ones: 0..n-1).
        checkpoint_every: checkpoint every this many steps when a directory is given; the
            last step is always checkpointed; 0 checkpoints only at the end.
        seed: seeds torch / random / numpy for dropout at the start of a fresh run.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (cuda when available, else cpu).
        stop_on_nonfinite: stop at the first NaN/Inf training loss (recorded, not applied).
    """

    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 100
    schedule: str = "inverse_sqrt"
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    clip_norm: float | None = None
    z_loss: float = 0.0
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 0
    seed: int = 0
    device: str = "auto"
    stop_on_nonfinite: bool = True

    def __post_init__(self) -> None:
        _check(self.steps >= 1, "steps", self.steps, "must be >= 1")
        _check(self.batch_size >= 1, "batch_size", self.batch_size, "must be >= 1")
        _check(math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "must be a finite number > 0")
        _check(self.warmup >= 0, "warmup", self.warmup, "must be >= 0")
        _check(self.schedule in SCHEDULES, "schedule", self.schedule, f"must be one of {list(SCHEDULES)}")
        _check(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), "betas", self.betas,
               "must be two numbers in [0, 1)")
        _check(self.eps > 0, "eps", self.eps, "must be > 0")
        _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        _check(0.0 <= self.label_smoothing < 1.0, "label_smoothing", self.label_smoothing, "must be in [0, 1)")
        _check(self.clip_norm is None or self.clip_norm > 0, "clip_norm", self.clip_norm, "must be None or > 0")
        _check(math.isfinite(self.z_loss) and self.z_loss >= 0, "z_loss", self.z_loss, "must be a finite number >= 0")
        _check(self.eval_every >= 0, "eval_every", self.eval_every, "must be >= 0")
        _check(self.eval_batches >= 1, "eval_batches", self.eval_batches, "must be >= 1")
        _check(self.checkpoint_every >= 0, "checkpoint_every", self.checkpoint_every, "must be >= 0")
        _check(self.device in DEVICES, "device", self.device, f"must be one of {list(DEVICES)}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))

    def replace(self, **changes: object) -> TrainConfig:
        """Returns a copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """The recipe in one line, for figure footers."""
        warm = f"{self.warmup}-step linear warm-up, " if self.warmup else "no warm-up, "
        return (f"{self.steps} step{'s' if self.steps != 1 else ''}, Adam β=({self.betas[0]:g}, {self.betas[1]:g}), peak lr {self.lr:g}, "
                f"{warm}{self.schedule} schedule, label smoothing {self.label_smoothing:g}, "
                f"{f'z-loss {self.z_loss:g}, ' if self.z_loss else ''}"
                f"loss in nats (mean over target tokens), seed {self.seed}")


def _check(ok: bool, field: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"TrainConfig.{field}={value!r} {why}")


def resolve_device(device: str) -> torch.device:
    """Maps ``"auto"`` to cuda when available, else cpu; other names pass through."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("TrainConfig.device='cuda' but torch.cuda.is_available() is False")
    return torch.device(device)

