"""Per-step device buffers and the host-side row store.

During a recorded step every hook appends a 0-d device tensor and a key; at the end of the
step all values reach the host in one transfer. Rows are kept as compact arrays (interned
keys + float64 values), so memory grows by ~20 bytes per row, not by a Python dict per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from gradscope.table import COLUMNS, DTYPES, empty_frame

# key = (micro_step, stack, layer, site, quantity, layer_j, role)
Key = tuple[int, str, "int | None", str, str, "int | None", str]


@dataclass
class StepBuffer:
    """Device values and their keys for one recorded step.

    Hooks append 0-d device tensors; a value several keys share (one tensor seen by several
    sites) is stored once. ``to_host`` stacks them, with the vectors and matrices, into one
    device vector and moves it to the host in one transfer.
    """

    keys: list[Key] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # row -> index into scalars
    scalars: list[torch.Tensor] = field(default_factory=list)
    vectors: list[tuple[list[Key], torch.Tensor]] = field(default_factory=list)
    matrices: list[tuple[int, str, str, str, torch.Tensor]] = field(default_factory=list)
    host: list[tuple[Key, float]] = field(default_factory=list)
    blocks: dict[str, torch.Tensor] = field(default_factory=dict)  # raw arrays that travel with the rows

    def add(self, key: Key, value: torch.Tensor) -> None:
        """Appends one 0-d float32 tensor (kept on its device)."""
        self.keys.append(key)
        self.slots.append(len(self.scalars))
        self.scalars.append(value)

    def add_shared(self, keys: list[Key], value: torch.Tensor) -> None:
        """Appends one 0-d float32 tensor under several keys."""
        self.keys.extend(keys)
        self.slots.extend([len(self.scalars)] * len(keys))
        self.scalars.append(value)

    def add_float(self, key: Key, value: float) -> None:
        """Appends a value already on the host."""
        self.host.append((key, float(value)))

    def add_many(self, keys: list[Key], values: torch.Tensor) -> None:
        """Appends a 1-d tensor of values, one per key."""
        self.vectors.append((keys, values.detach().reshape(-1)))

    def add_matrix(self, micro: int, stack: str, site: str, quantity: str, matrix: torch.Tensor) -> None:
        """Appends a matrix quantity; row i, column j become (layer=i, layer_j=j)."""
        self.matrices.append((micro, stack, site, quantity, matrix.detach()))

    def add_block(self, name: str, values: torch.Tensor) -> None:
        """Appends a raw array (the step's captured snapshots) that travels in the same transfer."""
        self.blocks[name] = values.detach()

    def to_host(self) -> tuple[list[Key], np.ndarray, dict[str, np.ndarray]]:
        """Moves everything to the host in one transfer; returns (keys, float64 values, blocks)."""
        parts = [_stack_across_devices(self.scalars)] if self.scalars else []
        keys = list(self.keys)
        for vector_keys, values in self.vectors:
            parts.append(values.float())
            keys += vector_keys
        for micro, stack, site, quantity, m in self.matrices:
            rows, cols = m.shape
            parts.append(m.float().reshape(-1))
            keys += [(micro, stack, i, site, quantity, j, "") for i in range(rows) for j in range(cols)]
        n_rows = sum(p.numel() for p in parts)
        parts += [b.float().reshape(-1) for b in self.blocks.values()]
        flat = torch.cat([p.to(parts[0].device) for p in parts]).cpu().double().numpy() if parts else np.zeros(0)
        blocks, at = {}, n_rows
        for name, b in self.blocks.items():
            blocks[name] = flat[at: at + b.numel()].reshape(b.shape)
            at += b.numel()
        flat = flat[:n_rows]
        n_scalars = len(self.scalars)
        values = np.concatenate([flat[np.asarray(self.slots, dtype=np.int64)], flat[n_scalars:],
                                 np.array([v for _, v in self.host], dtype=np.float64)])
        keys += [k for k, _ in self.host]
        return keys, values, blocks


def _stack_across_devices(scalars: list[torch.Tensor]) -> torch.Tensor:
    """The 0-d values as one float32 vector on the first value's device (a model split over
    several devices gives values on each; they are moved once, as one vector per device)."""
    device = scalars[0].device
    if all(s.device == device for s in scalars):
        return torch.stack(scalars).float()
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(scalars):
        by_device.setdefault(s.device, []).append(i)
    out = torch.empty(len(scalars), device=device)
    for dev, idx in by_device.items():
        out[torch.tensor(idx, device=device)] = torch.stack([scalars[i] for i in idx]).float().to(device)
    return out


class RowStore:
    """Host-side rows of the tidy table, stored as interned keys and value arrays."""

    def __init__(self) -> None:
        self._key_index: dict[Key, int] = {}
        self._keys: list[Key] = []
        self._chunks: list[tuple[int, np.ndarray, np.ndarray]] = []  # (step, key ids, values)

    def append(self, step: int, keys: list[Key], values: np.ndarray) -> None:
        """Adds one step's rows."""
        if not keys:
            return
        ids = np.fromiter((self._intern(k) for k in keys), dtype=np.int32, count=len(keys))
        self._chunks.append((step, ids, np.asarray(values, dtype=np.float64)))

    def _intern(self, key: Key) -> int:
        idx = self._key_index.get(key)
        if idx is None:
            idx = self._key_index[key] = len(self._keys)
            self._keys.append(key)
        return idx

    def __len__(self) -> int:
        return sum(len(ids) for _, ids, _ in self._chunks)

    def steps(self) -> list[int]:
        """Steps present, in recording order."""
        return [s for s, _, _ in self._chunks]

    def state_dict(self) -> dict:
        """Keys and chunks as lists and tensors, safe for ``torch.load(weights_only=True)``."""
        return {
            "keys": [list(k) for k in self._keys],
            "chunks": [(step, torch.from_numpy(ids.copy()), torch.from_numpy(values.copy())) for step, ids, values in self._chunks],
        }

    def load_state_dict(self, state: dict) -> None:
        """Replaces the stored rows with those of :meth:`state_dict`."""
        self._keys = [(*k, "")[:7] if len(k) == 6 else tuple(k) for k in state["keys"]]  # older checkpoints: no role
        self._key_index = {k: i for i, k in enumerate(self._keys)}
        self._chunks = [(int(step), ids.numpy().astype(np.int32), values.numpy().astype(np.float64))
                        for step, ids, values in state["chunks"]]

    def frame(self, *, run: str, variant: str, rank: int, reduction: str) -> pd.DataFrame:
        """The canonical tidy table of everything stored."""
        if not self._chunks:
            return empty_frame()
        steps = np.concatenate([np.full(len(ids), s, dtype=np.int64) for s, ids, _ in self._chunks])
        ids = np.concatenate([ids for _, ids, _ in self._chunks])
        values = np.concatenate([v for _, _, v in self._chunks])
        keys = pd.DataFrame(self._keys, columns=["micro_step", "stack", "layer", "site", "quantity", "layer_j", "role"])
        rows = keys.iloc[ids].reset_index(drop=True)
        data = {
            "run": run,
            "variant": variant,
            "step": steps,
            "micro_step": rows["micro_step"].to_numpy(np.int64),
            "rank": rank,
            "stack": rows["stack"].to_numpy(),
            "layer": pd.array(rows["layer"].tolist(), dtype="Int64"),
            "site": rows["site"].to_numpy(),
            "quantity": rows["quantity"].to_numpy(),
            "value": values,
            "layer_j": pd.array(rows["layer_j"].tolist(), dtype="Int64"),
            "reduction": reduction,
            "role": rows["role"].to_numpy(),
        }
        return pd.DataFrame(data, columns=list(COLUMNS)).astype(DTYPES)
