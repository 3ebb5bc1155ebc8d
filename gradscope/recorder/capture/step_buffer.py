"""The device buffer of one recorded step.

During a recorded step every hook appends a 0-d device tensor and a key; at the end of the
step all values reach the host in one transfer (:meth:`StepBuffer.transfer`). What the host
then does with them (keys, indexing, numpy arrays) waits in a :class:`Transferred` until the
step's rows are built, off the training step (:mod:`gradscope.recorder.rows.late_rows`). The host
keeps rows in :class:`gradscope.table.rows.RowStore`.
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
    sites) is stored once. ``transfer`` stacks them, with the vectors and matrices, into one
    device vector and moves it to the host in one transfer.
    """

    keys: list[Key] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # row -> index into scalars
    scalars: list[torch.Tensor] = field(default_factory=list)
    vectors: list[tuple[list[Key], torch.Tensor]] = field(default_factory=list)
    matrices: list[tuple[int, str, str, str, torch.Tensor]] = field(default_factory=list)
    host: list[tuple[Key, float]] = field(default_factory=list)
    blocks: dict[str, tuple[list[torch.Tensor], tuple]] = field(default_factory=dict)  # raw arrays (pieces, shape)

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

    def add_block(self, name: str, values: torch.Tensor | list[torch.Tensor], shape: tuple[int, ...] | None = None
                  ) -> None:
        """Appends a raw array that travels in the same transfer: a tensor, or the pieces of
        one (flattened and joined in the transfer itself, no operation of their own) and
        ``shape``, its shape on the host."""
        pieces = [values] if isinstance(values, torch.Tensor) else values
        self.blocks[name] = ([t.detach().reshape(-1) for t in pieces],
                             tuple(values.shape) if shape is None else shape)

    def transfer(self) -> Transferred:
        """Moves every value to the host in one transfer (one ``cat`` on the device, one copy);
        the rest, host work, waits in the :class:`Transferred` it returns."""
        parts = [_stack_across_devices(self.scalars)] if self.scalars else []
        parts += [values for _, values in self.vectors]
        parts += [m.reshape(-1) for *_, m in self.matrices]
        n_rows = sum(p.numel() for p in parts)
        parts += [piece for pieces, _ in self.blocks.values() for piece in pieces]
        if not parts:
            flat = torch.zeros(0, dtype=torch.float64)
        else:
            device = parts[0].device
            flat = torch.cat([p if p.device == device and p.dtype == torch.float32 else p.to(device, torch.float32)
                              for p in parts]).cpu()
        return Transferred(flat, n_rows, self.keys, self.slots, len(self.scalars), [keys for keys, _ in self.vectors],
                           [(micro, stack, site, quantity, *m.shape) for micro, stack, site, quantity, m in self.matrices],
                           [(name, sum(p.numel() for p in pieces), shape) for name, (pieces, shape) in self.blocks.items()],
                           self.host)


@dataclass
class Transferred:
    """A recorded step's values on the host, as one float32 vector, and the bookkeeping to
    read them (no device tensor: what the step captured can go): turned into keys and
    arrays (:meth:`arrays`) when the rows are built."""

    flat: torch.Tensor
    n_rows: int  # values of rows at the start of ``flat``; the blocks follow
    keys: list[Key]  # of the scalars' rows
    slots: list[int]  # row -> index into the scalars
    n_scalars: int
    vector_keys: list[list[Key]]
    matrices: list[tuple[int, str, str, str, int, int]]  # (micro, stack, site, quantity, rows, cols)
    blocks: list[tuple[str, int, tuple]]  # (name, elements, shape)
    host: list[tuple[Key, float]]

    def arrays(self) -> tuple[list[Key], np.ndarray, dict[str, np.ndarray]]:
        """(keys, float64 values, blocks): one value per key, and each block with its shape."""
        flat = self.flat.double().numpy()
        keys = list(self.keys)
        for vector_keys in self.vector_keys:
            keys += vector_keys
        for micro, stack, site, quantity, rows, cols in self.matrices:
            keys += [Key(micro, stack, i, site, quantity, j, "") for i in range(rows) for j in range(cols)]
        blocks, at = {}, self.n_rows
        for name, n, shape in self.blocks:
            blocks[name] = flat[at: at + n].reshape(shape)
            at += n
        values = np.concatenate([flat[np.asarray(self.slots, dtype=np.int64)], flat[self.n_scalars:self.n_rows],
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
