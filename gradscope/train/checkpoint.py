"""Atomic checkpoints that let a run resume bit-identically.

A checkpoint is one ``torch.save`` dict (loadable with ``weights_only=True``): model,
optimizer and scheduler state, every RNG state (torch CPU, CUDA, Python ``random``,
NumPy's global generator), the step, the config and the run's rows so far (the store's state). It is
written to a temporary file in the same directory and moved into place with
``os.replace``, so a crash never leaves a half-written ``last.pt``.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_NAME = "last.pt"


def checkpoint_path(checkpoint_dir: str | Path) -> Path:
    """The checkpoint file inside ``checkpoint_dir``."""
    return Path(checkpoint_dir) / CHECKPOINT_NAME


def get_rng_state() -> dict[str, Any]:
    """Captures torch (CPU and every CUDA device), Python and NumPy global RNG states."""
    np_state = np.random.get_state(legacy=False)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"], "key": torch.from_numpy(np_state["state"]["key"].copy()),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores the states captured by ``get_rng_state``."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npy = state["numpy"]
    np.random.set_state({"bit_generator": npy["bit_generator"],
                         "state": {"key": npy["key"].numpy().astype(np.uint32), "pos": npy["pos"]},
                         "has_gauss": npy["has_gauss"], "gauss": npy["gauss"]})


def save_checkpoint(checkpoint_dir: str | Path, state: dict[str, Any]) -> Path:
    """Writes ``state`` atomically to ``checkpoint_dir/last.pt`` and returns the path."""
    path = checkpoint_path(checkpoint_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".last.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """Loads ``checkpoint_dir/last.pt`` onto the CPU, or returns None when there is none.

    Always CPU: RNG states must stay CPU tensors; ``load_state_dict`` moves model and
    optimizer tensors to their parameters' device.
    """
    path = checkpoint_path(checkpoint_dir)
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)
