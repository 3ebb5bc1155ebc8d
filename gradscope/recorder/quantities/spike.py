"""The ``spike`` quantity: a value far above its own recent past (OLMo-core's stability rule).

A recorded value v of a series is a *spike* when v − mean > 6·std of the same series'
previous 128 recorded values (OLMo-core's ``SkipStepOptimizer``: ``sigma_factor=6``,
``rolling_interval_length=128``; std with Bessel's correction, as ``torch.std_mean``;
non-finite values left out of the window, as OLMo-core's later version does). No verdict
until the window holds at least 64 finite values (OLMo-core waits for
``rolling_interval_length // 2``). A spike stays in the window, as in OLMo-core.

The series watched are ``act_grad_norm`` at every site and ``param_grad_norm`` of every
parameter group (the step's accumulated rows, ``micro_step == -1``); their site names never
coincide (activation sites end in ``.in``/``.out``/``.branch``/``.sum``..., parameter
groups are module prefixes, ``""`` the total), so a spike row names its series by its
site, and its ``role`` (set for activation sites, ``""`` for parameter groups) tells which
quantity spiked. The row's value is the z-score (v − mean)/std, above 6.

Two implementations of one rule, tested against each other:

- :class:`SpikeDetector`, online, inside the Recorder: a ring buffer of the last 128 values
  per series on the host, updated once per recorded step with numpy, after the step's one
  device→host transfer (no per-site synchronisation, no device work);
- :func:`find_spikes`, offline, on a table (pandas rolling windows), for runs recorded
  without ``spike`` and for the report.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from gradscope.recorder.quantities.registry import REGISTRY
from gradscope.table.keys import Key

SPIKE = "spike"
WATCHED: tuple[str, ...] = tuple(name for name, q in REGISTRY.items() if q.spike_watched)
"""The built-in quantities whose ``spike_watched`` is set (a Recorder watches those of its
own quantities, a user's included)."""
WINDOW = 128
SIGMAS = 6.0


class SpikeDetector:
    """Flags spikes in every watched series as a run is recorded.

    Args:
        window: previous values per series (default 128).
        sigmas: threshold in standard deviations above the mean (default 6).
        watch: quantities whose series are watched (default :data:`WATCHED`).
        min_history: finite previous values a series needs before a verdict (default
            ``window // 2``, as OLMo-core; the replay watch of
            :mod:`gradscope.recorder.replay.replay` uses 16).
    """

    def __init__(self, window: int = WINDOW, sigmas: float = SIGMAS, watch: tuple[str, ...] = WATCHED,
                 min_history: int | None = None) -> None:
        if window < 4:
            raise ValueError(f"spike window: must be >= 4, got {window}")
        min_history = window // 2 if min_history is None else min_history
        if not 2 <= min_history <= window:
            raise ValueError(f"spike min_history: must be between 2 and the window ({window}), got {min_history}")
        self.window, self.sigmas, self.watch = window, float(sigmas), frozenset(watch)
        self.min_history = min_history
        self._index: dict[tuple, int] = {}
        self._ring = np.full((0, window), np.nan)  # (series, window): previous values, NaN = empty or non-finite
        self._seen = np.zeros(0, dtype=np.int64)  # values pushed per series

    def state_dict(self) -> dict:
        """The windows of every series, as plain containers and tensors (a checkpoint)."""
        return {"keys": [list(k) for k in self._index], "ring": torch.from_numpy(self._ring.copy()),
                "seen": torch.from_numpy(self._seen.copy())}

    def load_state_dict(self, state: dict) -> None:
        """Restores the windows :meth:`state_dict` saved (a resumed run judges its first
        steps against the history it had, not against none)."""
        ring = state["ring"].numpy()
        if ring.shape[1:] != (self.window,):
            raise ValueError(f"spike state: a window of {ring.shape[1:]} values, this detector keeps {self.window}")
        self._index = {Key(*k): i for i, k in enumerate(state["keys"])}
        self._ring, self._seen = ring.copy(), state["seen"].numpy().copy()

    def _ids(self, keys: list[Key]) -> tuple[np.ndarray, np.ndarray]:
        rows, ids = [], []
        for i, k in enumerate(keys):
            if k.micro_step == -1 and k.quantity in self.watch:
                idx = self._index.get(k)
                if idx is None:
                    idx = self._index[k] = len(self._index)
                rows.append(i)
                ids.append(idx)
        n = len(self._index)
        if n > len(self._seen):  # new series: grow the ring
            self._ring = np.vstack([self._ring, np.full((n - len(self._seen), self.window), np.nan)])
            self._seen = np.concatenate([self._seen, np.zeros(n - len(self._seen), dtype=np.int64)])
        return np.asarray(rows, dtype=np.int64), np.asarray(ids, dtype=np.int64)

    def rows(self, keys: list[Key], values: np.ndarray) -> tuple[list[Key], np.ndarray]:
        """Checks one piece of a step's rows, then adds their values to the windows.

        Args:
            keys: row keys.
            values: their values.

        Returns:
            (keys, z-scores) of the spike rows found (empty when none).
        """
        keys = [k if isinstance(k, Key) else Key(*k) for k in keys]
        rows, ids = self._ids(keys)
        if not len(ids):
            return [], np.zeros(0)
        v = np.asarray(values, dtype=np.float64)[rows]
        past = self._ring[ids]  # (n, window)
        ok = np.isfinite(past)
        n = ok.sum(axis=1)
        mean = np.where(ok, past, 0.0).sum(axis=1) / np.maximum(n, 1)
        var = np.where(ok, (past - mean[:, None]) ** 2, 0.0).sum(axis=1) / np.maximum(n - 1, 1)
        std = np.sqrt(var)
        with np.errstate(divide="ignore", invalid="ignore"):
            z = (v - mean) / std
        hit = (n >= self.min_history) & np.isfinite(v) & (v - mean > self.sigmas * std)
        self._ring[ids, self._seen[ids] % self.window] = np.where(np.isfinite(v), v, np.nan)
        self._seen[ids] += 1
        found = np.flatnonzero(hit)
        out = [keys[r]._replace(quantity=SPIKE, layer_j=None) for r in rows[found].tolist()]
        return out, z[found]


def too_few_for_spikes(steps: int, window: int = WINDOW) -> str | None:
    """Why a series of ``steps`` values cannot show a spike yet (the rule needs half a
    window of earlier values), or None when it can."""
    if steps > window // 2:
        return None
    return f"too few steps to look for spikes ({steps}; the rule needs more than {window // 2})"


def find_spikes(df: pd.DataFrame, *, window: int = WINDOW, sigmas: float = SIGMAS,
                watch: tuple[str, ...] = WATCHED) -> pd.DataFrame:
    """The spike rows a :class:`SpikeDetector` would have recorded, computed from a table.

    Args:
        df: a gradscope table (any runs and ranks; only ``watch`` rows with
            ``micro_step == -1`` are used). Each series is taken in step order.
        window: previous values per series (default 128).
        sigmas: threshold in standard deviations (default 6).
        watch: quantities whose series are checked.

    Returns:
        Rows with ``quantity == "spike"`` and the z-score as ``value``, other columns as the
        spiking row's; empty (same columns) when nothing spiked.
    """
    rows = df[df.quantity.isin(list(watch)) & (df.micro_step == -1)]
    if rows.empty:
        return df.iloc[0:0]
    series = ["run", "rank", "quantity", "stack", "layer", "site", "role"]
    rows = rows.sort_values(series + ["step"], kind="stable")
    finite = rows.value.where(np.isfinite(rows.value))
    past = finite.groupby([rows[c] for c in series], dropna=False, sort=False).shift(1)
    group = [rows[c] for c in series]
    roll = past.groupby(group, dropna=False, sort=False).rolling(window, min_periods=window // 2)
    mean = roll.mean().reset_index(level=list(range(len(series))), drop=True).reindex(rows.index)
    std = roll.std().reset_index(level=list(range(len(series))), drop=True).reindex(rows.index)
    hit = np.isfinite(rows.value) & mean.notna() & (rows.value - mean > sigmas * std)
    out = rows[hit].copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        out["value"] = ((rows.value - mean) / std)[hit]
    out["quantity"] = SPIKE
    return out.astype(df.dtypes.to_dict()).reset_index(drop=True)
