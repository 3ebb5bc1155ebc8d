"""The device buffer of one recorded step.

During a recorded step every hook appends a 0-d device tensor and a key; at the end of the
step all values reach the host in one transfer. The host keeps rows in
:class:`gradscope.table.rows.RowStore`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gradscope.table.keys import Key


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
            keys += [Key(micro, stack, i, site, quantity, j, "") for i in range(rows) for j in range(cols)]
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
