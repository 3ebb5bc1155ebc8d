"""Training: built-in synthetic tasks, parallel-text loading and a resumable loop.

Public API::

    from gradscope.train import TrainConfig, make_task, train
    task = make_task("reverse", vocab=16, max_len=12, seed=0)
    result = train(model, task, TrainConfig(steps=300, lr=3e-3, warmup=50))
    result.history  # tidy table: loss / lr per step, val_loss every eval_every steps

Losses are label-smoothed cross entropies in nats, averaged over non-pad target tokens.
"""

from gradscope.train.checkpoint import load_checkpoint, save_checkpoint
from gradscope.train.config import TrainConfig, resolve_device
from gradscope.train.bounds import LossBounds, loss_bounds
from gradscope.train.loop import TrainResult, evaluate, evaluate_metrics, seed_everything, train
from gradscope.train.optim import (
    LOSS_LOG_BASE,
    LOSS_REDUCTION,
    label_smoothed_loss,
    lr_factor,
    make_optimizer,
    make_scheduler,
)
from gradscope.train.tasks import (
    BOS,
    EOS,
    TASKS,
    MarkovLMTask,
    MarkovMLMTask,
    ReverseTask,
    SortNoisyTask,
    Task,
    make_task,
)
from gradscope.train.text import ParallelTextTask, Vocab, load_parallel_text

__all__ = [
    "BOS",
    "EOS",
    "LossBounds",
    "LOSS_LOG_BASE",
    "LOSS_REDUCTION",
    "TASKS",
    "MarkovLMTask",
    "MarkovMLMTask",
    "ParallelTextTask",
    "ReverseTask",
    "SortNoisyTask",
    "Task",
    "TrainConfig",
    "TrainResult",
    "Vocab",
    "evaluate",
    "evaluate_metrics",
    "label_smoothed_loss",
    "load_checkpoint",
    "load_parallel_text",
    "loss_bounds",
    "lr_factor",
    "make_optimizer",
    "make_scheduler",
    "make_task",
    "resolve_device",
    "save_checkpoint",
    "seed_everything",
    "train",
]
