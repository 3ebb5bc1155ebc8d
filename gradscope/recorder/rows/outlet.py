"""Where a finished step's rows go: the spike check, then memory and/or the sinks.

One :class:`Outlet` per Recorder. Without a :class:`~gradscope.sinks.parquet.ParquetSink`
the rows are kept in memory (the Recorder's ``RowStore``) as before, and ``frame()`` reads
them there; with one (``log_dir=``) nothing is kept in memory beyond its flush buffer, and
``frame()`` reads this rank's parts in ``log_dir`` (an earlier run's too, when a run is
resumed into its folder) plus the buffer, as ``gradscope.load`` would. Other sinks (TensorBoard,
W&B) receive the same rows either way.
"""

from __future__ import annotations

import os

import numpy as np
import pandas as pd

from gradscope.recorder.quantities.spike import SpikeDetector
from gradscope.sinks.base import RunInfo, Sink
from gradscope.sinks.parquet import ParquetSink
from gradscope.table.keys import Key
from gradscope.table.rows import RowStore


def make_sinks(log_dir: str | os.PathLike | None, flush_every: int, sinks) -> list[Sink]:
    """The Recorder's sinks: a ParquetSink for ``log_dir`` (if given), then ``sinks``.

    Raises:
        TypeError: an entry of ``sinks`` is not a :class:`Sink` (a single sink is taken as a
            list of one).
        ValueError: two ParquetSinks, or an empty ``log_dir``.
    """
    sinks = [sinks] if isinstance(sinks, Sink) else list(sinks or ())
    bad = [s for s in sinks if not isinstance(s, Sink)]
    if bad:
        raise TypeError(f"sinks: expected gradscope.sinks.Sink instances, got {[type(s).__name__ for s in bad]}")
    if log_dir is not None:
        if not str(log_dir).strip():
            raise ValueError("log_dir: an empty path; give the run's folder (Recorder(log_dir='runs/exp1')), or None to "
                             "keep the table in memory")
        sinks.insert(0, ParquetSink(log_dir, flush_every=flush_every))
    if sum(s.keeps_rows for s in sinks) > 1:
        raise ValueError("sinks: at most one sink that keeps the rows (a ParquetSink, log_dir=) per Recorder")
    return sinks


class Outlet:
    """Sends each piece of a step's rows to memory or disk and to every sink.

    Args:
        store: the Recorder's in-memory store, used when no sink writes parquet.
        sinks: from :func:`make_sinks`; opened here.
        info: the run-wide columns.
        spikes: a :class:`SpikeDetector` when ``spike`` is recorded, else None.
    """

    def __init__(self, store: RowStore, sinks: list[Sink], info: RunInfo, spikes: SpikeDetector | None) -> None:
        self.sinks, self.info, self.spikes = sinks, info, spikes
        self.disk = next((s for s in sinks if s.keeps_rows), None)  # (make_sinks allows one)
        self.memory = store if self.disk is None else None
        opened = []
        try:
            for s in sinks:
                s.open(info)
                opened.append(s)
        except BaseException:
            for s in opened:
                s.close()
            raise

    def begin(self, step: int) -> None:
        """A recorded step starts."""
        for s in self.sinks:
            s.begin(step)

    def ran(self, step: int) -> None:
        """A step that is not recorded ran (the ``log_dir`` sink notes that this session owns it)."""
        for s in self.sinks:
            s.ran(step)

    def append(self, step: int, keys: list[Key], values: np.ndarray) -> None:
        """One piece of step ``step``'s rows (the spike rows it causes are added to it)."""
        if not keys:
            return
        if self.spikes is not None:
            spike_keys, z = self.spikes.rows(keys, values)
            if spike_keys:
                keys, values = list(keys) + spike_keys, np.concatenate([np.asarray(values, dtype=np.float64), z])
        if self.memory is not None:
            self.memory.append(step, keys, values)
        for s in self.sinks:
            s.append(step, keys, values)

    def writes_part_at(self, waiting: int) -> bool:
        """Whether the ``log_dir`` sink writes a part at the next step start, after
        ``waiting`` step starts that have not reached it yet."""
        return any(s.writes_part_at(waiting) for s in self.sinks)

    def frame(self) -> pd.DataFrame | None:
        """The rows written to disk so far, or None when they are kept in memory."""
        return self.disk.frame() if self.disk is not None else None

    def flush(self) -> None:
        """Flushes every sink."""
        for s in self.sinks:
            s.flush()

    def close(self) -> None:
        """Closes every sink (flushing them); the first error is raised after all are closed."""
        error = None
        for s in self.sinks:
            try:
                s.close()
            except Exception as err:  # close the others before raising
                error = error or err
        if error is not None:
            raise error
