"""The training loop: arch-agnostic, resumable, recorder-aware.

One step::

    batch = task.batch("train", step, B)
    with store.step(step):
        logits = model(*task.model_inputs(batch))
        loss = label_smoothed_loss(logits, task.targets(batch))
        loss.backward()
    value = loss.item()                          # the step's only host sync
    store.log("loss", value, step=step); store.log("lr", lr, step=step)
    clip; optimizer.step(); scheduler.step()     # skipped when the loss is non-finite
    store.log("val_loss", ...), store.log("val_accuracy", ...) every ``eval_every`` steps; checkpoint every ``checkpoint_every`` steps

One store per run: the loop logs its rows to the recorder it was given, and only there, so
``recorder.frame()`` is the whole run's table. Without a recorder, or with one that keeps no
rows (only a ``step`` context, maybe ``log``), the store is a :class:`~gradscope.train.history.History`
(a recorder with no model quantities) that passes ``step`` and ``log`` on to it.

Recorder protocol (duck-typed): ``recorder.run(step, closure, log_loss=False)`` (if present,
as ``gradscope.Recorder``'s, which may run the closure twice to replay a spike) or else
``recorder.step(step)``, a context manager, covers forward and backward and closes before
``optimizer.step()``;
``recorder.log(quantity, value, step=step)`` receives ``"loss"`` and ``"lr"`` every step and
``"val_loss"`` and ``"val_accuracy"`` (token accuracy) at each evaluation; ``recorder.frame()`` (with ``log``: the recorder is the
store) returns the table; ``recorder.attach_optimizer(optimizer)`` (if present) is called
once, and ``recorder.state_dict()`` / ``load_state_dict()`` (if present) travel in the
checkpoint, so a resumed run's table has every step exactly once.
Validation forwards run outside any ``recorder.step`` context.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from gradscope.train.checkpoint import get_rng_state, load_checkpoint, save_checkpoint, set_rng_state
from gradscope.train.config import TRAJECTORY_FIELDS, TrainConfig, resolve_device
from gradscope.train.history import LOOP_QUANTITIES, History, keeps_rows
from gradscope.train.optim import LOSS_LOG_BASE, LOSS_REDUCTION, label_smoothed_loss, make_optimizer, make_scheduler, z_loss
from gradscope.train.tasks import Task


@dataclass(frozen=True, eq=False)
class TrainResult:
    """What ``train`` returns.

    Attributes:
        step: the last step whose loss was computed (``config.steps`` unless the run
            diverged and stopped early, or a checkpoint was already past it).
        store: where the loop logged: the recorder given to ``train``, or its ``History``.
            ``store.frame()`` is the run's whole table.
        diverged: a training loss was NaN or Inf.
        resumed_from: the checkpoint step the run started from, or None.
        loss_reduction: ``"mean"`` over non-pad target tokens.
        loss_log_base: ``"e"``: losses are in nats.
    """

    step: int
    store: Any
    diverged: bool = False
    resumed_from: int | None = None
    loss_reduction: str = LOSS_REDUCTION
    loss_log_base: str = LOSS_LOG_BASE

    @functools.cached_property
    def history(self) -> pd.DataFrame:
        """The loop's rows of the store: tidy table (``gradscope.table`` columns) with
        quantities ``loss`` and ``lr`` every step and ``val_loss`` and ``val_accuracy`` every
        ``eval_every`` steps.
        With a ``gradscope.Recorder`` as the store, its ``run``, ``variant``, ``rank`` and
        ``reduction`` columns are the recorder's."""
        frame = self.store.frame()
        history = frame.loc[frame["quantity"].isin(list(LOOP_QUANTITIES))].reset_index(drop=True)
        history.attrs.update(loss_reduction=self.loss_reduction, loss_log_base=self.loss_log_base)
        return history

    def curve(self, quantity: str = "loss") -> pd.Series:
        """``value`` of one quantity indexed by step."""
        rows = self.history[self.history["quantity"] == quantity]
        return pd.Series(rows["value"].to_numpy(), index=rows["step"].to_numpy(), name=quantity)


def evaluate(model: nn.Module, task: Task, *, batch_size: int, n_batches: int, smoothing: float = 0.1,
             split: str = "valid", device: torch.device | str = "cpu") -> float:
    """Token-weighted label-smoothed loss (nats) over batches ``0..n_batches-1`` of ``split``.

    The model is put in eval mode and restored to its previous mode afterwards.
    """
    return evaluate_metrics(model, task, batch_size=batch_size, n_batches=n_batches, smoothing=smoothing,
                            split=split, device=device)[0]


@torch.no_grad()
def evaluate_metrics(model: nn.Module, task: Task, *, batch_size: int, n_batches: int, smoothing: float = 0.1,
                     split: str = "valid", device: torch.device | str = "cpu") -> tuple[float, float]:
    """:func:`evaluate`'s loss and the token accuracy (share of non-pad target tokens whose
    argmax logit is the target), both over batches ``0..n_batches-1`` of ``split``."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    right = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    try:
        for i in range(n_batches):
            cpu_batch = task.batch(split, i, batch_size)
            n = int((task.targets(cpu_batch) != task.pad_id).sum())  # counted on the CPU: no device sync
            batch = tuple(t.to(device) for t in cpu_batch)
            logits, target = model(*task.model_inputs(batch)), task.targets(batch)
            loss = label_smoothed_loss(logits, target, pad_id=task.pad_id, smoothing=smoothing)
            total += loss.double() * n
            right += ((logits.argmax(-1) == target) & (target != task.pad_id)).sum()
            tokens += n
    finally:
        model.train(was_training)
    return total.item() / tokens, right.item() / tokens


def train(model: nn.Module, task: Task, config: TrainConfig, *, recorder: Any = None,
          checkpoint_dir: str | Path | None = None, resume: bool = True, progress: bool = True,
          run: str = "run", variant: str = "") -> TrainResult:
    """Trains ``model`` on ``task`` with Adam, the inverse-sqrt schedule and label smoothing.

    Args:
        model: called as ``model(*task.model_inputs(batch))`` and returning logits
            (B, T, vocab); moved to the config's device in place.
        task: a built-in task (``make_task``) or ``load_parallel_text`` result.
        config: the ``TrainConfig``.
        recorder: optional object with ``step(step)`` (a context manager wrapped around
            forward + backward) and optionally ``log(quantity, value, step=step)``; with
            ``log`` and ``frame`` (a ``gradscope.Recorder``) it is the run's store and
            receives the loop's rows (``run`` and ``variant`` below are then its own).
        checkpoint_dir: where ``last.pt`` is written; None disables checkpoints.
        resume: when ``checkpoint_dir`` holds a checkpoint, continue from it. The result
            then equals an uninterrupted run bit for bit (same parameters and history);
            a checkpoint already at or past ``config.steps`` is returned as it is. With
            ``resume=False`` the run starts afresh and overwrites the checkpoint.
        progress: show a tqdm bar with loss and lr (hidden when stderr is not a tty).
        run: ``run`` column of the history (without a recorder that keeps rows).
        variant: ``variant`` column of the history (likewise).

    Returns:
        A ``TrainResult``.

    Raises:
        ValueError: the checkpoint was written under a config whose trajectory fields
            (``TRAJECTORY_FIELDS``) differ, or the logits' last dimension is not ``task.vocab``.
    """
    device = resolve_device(config.device)
    model.to(device)
    optimizer = make_optimizer(model, config)
    scheduler = make_scheduler(optimizer, config)
    store = recorder if keeps_rows(recorder) else History(run=run, variant=variant, hooks=recorder)
    start, resumed_from = 0, None
    state = load_checkpoint(checkpoint_dir) if checkpoint_dir is not None and resume else None
    if state is not None:
        _check_resumable(state["config"], config, checkpoint_dir)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        start = resumed_from = int(state["step"])
        if "recorder" in state and hasattr(store, "load_state_dict"):
            store.load_state_dict(state["recorder"])
        elif "history" in state and isinstance(store, History):  # LEGACY: the loop kept its rows apart
            store.load_state_dict({"rows": state["history"]})
    else:
        seed_everything(config.seed)

    step, diverged = start, False
    if hasattr(store, "attach_optimizer"):
        store.attach_optimizer(optimizer)
    model.train()
    bar = tqdm(total=config.steps, initial=start, desc=run, disable=None if progress else True, dynamic_ncols=True)
    try:
        for step in range(start + 1, config.steps + 1):
            batch = tuple(t.to(device, non_blocking=True) for t in task.batch("train", step, config.batch_size))
            lr = optimizer.param_groups[0]["lr"]
            optimizer.zero_grad(set_to_none=True)
            def forward_backward() -> torch.Tensor:  # may run twice: a replay (Recorder(on_spike=...))
                logits = model(*task.model_inputs(batch))  # (B, T, vocab)
                if logits.shape[-1] != task.vocab:
                    raise ValueError(f"model returned {logits.shape[-1]} logits per token; task.vocab={task.vocab}")
                loss = label_smoothed_loss(logits, task.targets(batch), pad_id=task.pad_id,
                                           smoothing=config.label_smoothing)
                objective = loss + config.z_loss * z_loss(logits, task.targets(batch), pad_id=task.pad_id) \
                    if config.z_loss else loss
                objective.backward()
                return loss

            if callable(getattr(store, "run", None)):
                loss = store.run(step, forward_backward, log_loss=False)
            else:
                with store.step(step):
                    loss = forward_backward()
            value = loss.item()
            store.log("loss", value, step=step)
            store.log("lr", lr, step=step)
            bar.update(1)
            bar.set_postfix(loss=f"{value:.4f}", lr=f"{lr:.3g}", refresh=False)
            if not math.isfinite(value):
                diverged = True
                if config.stop_on_nonfinite:
                    break
            if config.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
            optimizer.step()
            scheduler.step()
            if config.eval_every and step % config.eval_every == 0:
                val, accuracy = evaluate_metrics(model, task, batch_size=config.batch_size,
                                                 n_batches=config.eval_batches, smoothing=config.label_smoothing,
                                                 device=device)
                store.log("val_loss", val, step=step)
                store.log("val_accuracy", accuracy, step=step)
            every = config.checkpoint_every
            if checkpoint_dir is not None and (step == config.steps or (every and step % every == 0)):
                save_checkpoint(checkpoint_dir, {
                    "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "rng": get_rng_state(),
                    "config": dataclasses.asdict(config), "task": repr(task),
                    **({"recorder": store.state_dict()} if hasattr(store, "state_dict") else {}),
                })
    finally:
        bar.close()

    return TrainResult(step=step, store=store, diverged=diverged, resumed_from=resumed_from)


def seed_everything(seed: int) -> None:
    """Seeds torch (CPU and CUDA), Python ``random`` and NumPy's global generator."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _check_resumable(saved: dict[str, Any], config: TrainConfig, checkpoint_dir: str | Path) -> None:
    now = dataclasses.asdict(config)
    defaults = {"z_loss": 0.0}  # fields added later: a checkpoint written before them ran with the default
    diff = {k: (saved.get(k, defaults.get(k)), now[k]) for k in TRAJECTORY_FIELDS
            if _norm(saved.get(k, defaults.get(k))) != _norm(now[k])}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"cannot resume from {str(checkpoint_dir)!r}: {detail}; pass resume=False or another "
                         f"checkpoint_dir")


def _norm(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
