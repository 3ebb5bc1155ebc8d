"""The host-side rows of a run: interned keys and float64 values, framed on demand.

Rows are kept as compact arrays (interned :class:`~gradscope.table.keys.Key` s + float64
values), so memory grows by ~20 bytes per row, not by a Python dict per row.
"""

from __future__ import annotations

import operator

import numpy as np
import pandas as pd
import torch

from gradscope.table.keys import Key
from gradscope.table.schema import COLUMNS, DTYPES, empty_frame


class RowStore:
    """Host-side rows of the tidy table, stored as interned keys and value arrays."""

    def __init__(self) -> None:
        self._key_index: dict[Key, int] = {}
        self._keys: list[Key] = []
        self._chunks: list[tuple[int, np.ndarray, np.ndarray]] = []  # (step, key ids, values)
        self._last: dict[int, tuple[list[Key], np.ndarray]] = {}  # length -> the last append this long: keys, ids

    def append(self, step: int, keys: list[Key], values: np.ndarray) -> None:
        """Adds one step's rows."""
        if not keys:
            return
        last = self._last.get(len(keys))
        if last is not None:  # a step's rows: mostly the very Key objects of the step before (StepData.step_keys)
            ids = last[1].copy()
            for j, same in enumerate(map(operator.is_, keys, last[0])):
                if not same:
                    ids[j] = self._intern(keys[j])
        else:
            ids = np.fromiter((self._intern(k) for k in keys), dtype=np.int32, count=len(keys))
        if len(self._last) >= 16 and len(keys) not in self._last:  # (lengths that keep changing: keep a few)
            self._last.clear()
        self._last[len(keys)] = (list(keys), ids)
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

    def newest_writes(self) -> "RowStore":
        """The rows with each (step, quantity) from the last append that wrote it, as
        ``gradscope.load`` keeps them across part files: a step recorded again (a loop that
        repeats a step index) or a value logged again for a step replaces the earlier rows
        of its quantities. ``self`` when no step was appended twice (the usual case)."""
        steps = self.steps()
        if len(set(steps)) == len(steps):
            return self
        codes: dict[str, int] = {}
        quantity_of = np.array([codes.setdefault(k.quantity, len(codes)) for k in self._keys], dtype=np.int64)
        seen: set[tuple[int, int]] = set()
        kept = []
        for step, ids, values in reversed(self._chunks):
            quantities = quantity_of[ids]
            written = {(step, q) for q in np.unique(quantities).tolist()}
            replaced = [q for s, q in written & seen]
            if replaced:
                keep = ~np.isin(quantities, replaced)
                ids, values = ids[keep], values[keep]
            seen |= written
            if len(ids):
                kept.append((step, ids, values))
        out = RowStore()
        out._key_index, out._keys, out._chunks = self._key_index, self._keys, kept[::-1]
        return out

    def state_dict(self) -> dict:
        """Keys and chunks as lists and tensors, safe for ``torch.load(weights_only=True)``."""
        return {
            "keys": [list(k) for k in self._keys],
            "chunks": [(step, torch.from_numpy(ids.copy()), torch.from_numpy(values.copy())) for step, ids, values in self._chunks],
        }

    def load_state_dict(self, state: dict) -> None:
        """Replaces the stored rows with those of :meth:`state_dict`."""
        self._keys = [Key(*k, "") if len(k) == 6 else Key(*k) for k in state["keys"]]  # older checkpoints: no role
        self._key_index = {k: i for i, k in enumerate(self._keys)}
        self._last = {}
        self._chunks = [(int(step), ids.numpy().astype(np.int32), values.numpy().astype(np.float64))
                        for step, ids, values in state["chunks"]]

    def frame(self, *, run: str, variant: str, rank: int, reduction: str) -> pd.DataFrame:
        """The canonical tidy table of everything stored."""
        if not self._chunks:
            return empty_frame()
        steps = np.concatenate([np.full(len(ids), s, dtype=np.int64) for s, ids, _ in self._chunks])
        ids = np.concatenate([ids for _, ids, _ in self._chunks])
        values = np.concatenate([v for _, _, v in self._chunks])
        keys = pd.DataFrame(self._keys, columns=list(Key._fields))
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
