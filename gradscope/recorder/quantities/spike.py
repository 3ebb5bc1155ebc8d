"""The ``spike`` quantity: a value far above its own recent past, robust to warm-up transients.

A recorded value v of a series is a *spike* when, with L the natural logs of the same
series' previous 128 recorded values (those finite and > 0),

    z = (ln v − median(L)) / σ̂ > 6,    σ̂ = max(1.4826 · median(|L − median(L)|), 0.005)

the Hampel identifier (Hampel 1974; Pearson 2002, "Outliers in process modeling and
identification", Eq. 3: median ± t·1.4826·MAD) on log values. The window and the 6 are
OLMo-core's (``SkipStepOptimizer``: ``rolling_interval_length=128``, ``sigma_factor=6``);
its mean and std are replaced by the median and the MAD (1.4826·MAD estimates σ for
Gaussian values) because a mean and std are blinded by the few huge values of an early
transient: a gradient norm 1000× larger in the first steps of training inflates the std of
every later window that holds them, so a 50× jump at step 90 stays under mean + 6·std,
while the median and MAD of a window move by at most a few values' worth whatever those
values are (breakdown point 50%). Logs, because norms vary by factors: a 50× jump is
ln 50 ≈ 3.9 whatever the level. σ̂'s floor 0.005 (0.5%) keeps float noise, and the steps of
a bf16-rounded value (0.4–0.8% apart), on a series that barely moves from counting: nothing
under a 3% rise above the median is a spike.

No verdict until the window holds at least 64 usable values (OLMo-core waits for
``rolling_interval_length // 2``). Non-finite and non-positive values are never spikes and
stay out of the window (they take their slot as an empty one); a spike stays in the window.
The rule is lenient on a steep trend (the window's spread includes the trend) and never
flags a trend itself.

The series watched are ``act_grad_norm`` at every site and ``param_grad_norm`` of every
parameter group (the step's accumulated rows, ``micro_step == -1``); their site names never
coincide (activation sites end in ``.in``/``.out``/``.branch``/``.sum``..., parameter
groups are module prefixes, ``""`` the total), so a spike row names its series by its
site, and its ``role`` (set for activation sites, ``""`` for parameter groups) tells which
quantity spiked. The row's value is z, above 6.

One rule, :func:`robust_z`, used by both sides:

- :class:`SpikeDetector`, online, inside the Recorder: a ring buffer of the last 128 log
  values per series on the host, updated once per recorded step with numpy, after the
  step's one device→host transfer (no per-site synchronisation, no device work);
- :func:`find_spikes`, offline, on a table (each series' windows as a numpy sliding view),
  for runs recorded without ``spike`` and for the report.
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
MAD_TO_SIGMA = 1.4826  # 1/Φ⁻¹(3/4): 1.4826·MAD estimates σ of Gaussian values
SCALE_FLOOR = 5e-3  # σ̂ never below 0.5% (in log units)
RULE = (f"z = (ln v − median)/(1.4826·MAD) > {SIGMAS:g} over the log values of the series' previous {WINDOW} "
        "recorded values")
"""The rule in one line, for figure titles and reports."""


def log_values(values: np.ndarray) -> np.ndarray:
    """ln v where v is finite and > 0, else NaN (an empty slot of the window)."""
    v = np.asarray(values, dtype=np.float64)
    out = np.full(v.shape, np.nan)
    usable = np.isfinite(v) & (v > 0)
    np.log(v, out=out, where=usable)
    return out


def _nan_median(rows: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The median of each row's ``n`` finite values (a sort puts the NaNs last; several
    times faster than ``np.nanmedian`` or ``np.median`` on (series, 128) arrays)."""
    ordered = np.sort(rows, axis=1)
    at = np.arange(len(rows))
    return (ordered[at, (n - 1) // 2] + ordered[at, n // 2]) / 2


def robust_z(past: np.ndarray, current: np.ndarray, *, sigmas: float = SIGMAS,
             min_history: int = WINDOW // 2) -> tuple[np.ndarray, np.ndarray]:
    """The rule on log values: each row of ``past`` is one window, ``current`` its new value.

    Args:
        past: (n, window) log values, NaN for empty slots.
        current: (n,) log values of the values judged (NaN: never a spike).
        sigmas: threshold on z.
        min_history: usable values a window needs before a verdict.

    Returns:
        (z, hit): z-scores (NaN without a verdict) and whether each value is a spike.
    """
    n = np.isfinite(past).sum(axis=1)
    judged = (n >= min_history) & np.isfinite(current)
    z = np.full(len(current), np.nan)
    if judged.any():
        window, n = past[judged], n[judged]
        median = _nan_median(window, n)
        scale = np.maximum(MAD_TO_SIGMA * _nan_median(np.abs(window - median[:, None]), n), SCALE_FLOOR)
        z[judged] = (current[judged] - median) / scale
    return z, judged & (z > sigmas)


class SpikeDetector:
    """Flags spikes in every watched series as a run is recorded (the rule of :func:`robust_z`).

    Args:
        window: previous values per series (default 128).
        sigmas: threshold on the robust z-score (default 6).
        watch: quantities whose series are watched (default :data:`WATCHED`).
        min_history: usable previous values a series needs before a verdict (default
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
        self._ring = np.full((0, window), np.nan)  # (series, window): previous log values, NaN = empty
        self._seen = np.zeros(0, dtype=np.int64)  # values pushed per series

    def state_dict(self) -> dict:
        """The windows of every series, as plain containers and tensors (a checkpoint)."""
        return {"keys": [list(k) for k in self._index], "ring": torch.from_numpy(self._ring.copy()),
                "seen": torch.from_numpy(self._seen.copy()), "values": "log"}

    def load_state_dict(self, state: dict) -> None:
        """Restores the windows :meth:`state_dict` saved (a resumed run judges its first
        steps against the history it had, not against none). A checkpoint of the earlier
        mean/std rule (raw values in its windows) is converted to log values."""
        ring = state["ring"].numpy()
        if ring.shape[1:] != (self.window,):
            raise ValueError(f"spike state: a window of {ring.shape[1:]} values, this detector keeps {self.window}")
        self._index = {Key(*k): i for i, k in enumerate(state["keys"])}
        self._ring = ring.copy() if state.get("values") == "log" else log_values(ring)
        self._seen = state["seen"].numpy().copy()

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
        v = log_values(np.asarray(values, dtype=np.float64)[rows])
        z, hit = robust_z(self._ring[ids], v, sigmas=self.sigmas, min_history=self.min_history)
        self._ring[ids, self._seen[ids] % self.window] = v
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


SERIES = ["run", "rank", "quantity", "stack", "layer", "site", "role"]
"""The columns that name one watched series."""


def _windows(logs: np.ndarray, window: int) -> np.ndarray:
    """(T, window): row t holds the ``window`` values before t (NaN before the series began)."""
    padded = np.concatenate([np.full(window, np.nan), logs])
    return np.lib.stride_tricks.sliding_window_view(padded, window)[: len(logs)]


def find_spikes(df: pd.DataFrame, *, window: int = WINDOW, sigmas: float = SIGMAS,
                watch: tuple[str, ...] = WATCHED, min_history: int | None = None) -> pd.DataFrame:
    """The spike rows a :class:`SpikeDetector` would have recorded, computed from a table.

    Args:
        df: a gradscope table (any runs and ranks; only ``watch`` rows with
            ``micro_step == -1`` are used). Each series is taken in step order.
        window: previous values per series (default 128).
        sigmas: threshold on the robust z-score (default 6).
        watch: quantities whose series are checked.
        min_history: usable previous values before a verdict (default ``window // 2``).

    Returns:
        Rows with ``quantity == "spike"`` and the z-score as ``value``, other columns as the
        spiking row's; empty (same columns) when nothing spiked.
    """
    rows = df[df.quantity.isin(list(watch)) & (df.micro_step == -1)]
    if rows.empty:
        return df.iloc[0:0]
    min_history = window // 2 if min_history is None else min_history
    rows = rows.sort_values(SERIES + ["step"], kind="stable")
    z = np.full(len(rows), np.nan)
    hit = np.zeros(len(rows), dtype=bool)
    for at in rows.groupby(SERIES, dropna=False, sort=False).indices.values():
        logs = log_values(rows.value.to_numpy()[at])
        z[at], hit[at] = robust_z(_windows(logs, window), logs, sigmas=sigmas, min_history=min_history)
    out = rows[hit].copy()
    out["value"] = z[hit]
    out["quantity"] = SPIKE
    return out.astype(df.dtypes.to_dict()).reset_index(drop=True)


def first_judged_step(df: pd.DataFrame, *, window: int = WINDOW, min_history: int | None = None) -> int | None:
    """The first step at which the rule can judge any series of ``df`` (one watched
    quantity of one run and rank, ``micro_step == -1``): where a series has
    ``min_history`` usable earlier values within its window. None when no series gets there."""
    min_history = window // 2 if min_history is None else min_history
    first = None
    for _, series in df[df.micro_step == -1].sort_values("step").groupby(SERIES, dropna=False, sort=False):
        usable = np.isfinite(log_values(series.value.to_numpy()))
        counts = pd.Series(usable.astype(float)).shift(1).rolling(window, min_periods=1).sum().to_numpy()
        ready = np.flatnonzero(counts >= min_history)
        if len(ready):
            step = int(series.step.iloc[ready[0]])
            first = step if first is None else min(first, step)
    return first
