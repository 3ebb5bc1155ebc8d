"""What a Recorder recorded, read back, saved and checkpointed: :class:`RecordedTable`, the
table side a :class:`~gradscope.recorder.recorder.Recorder` holds.

The rows of recorded steps wait in the :class:`~gradscope.recorder.rows.late_rows.LateRows`
queue until read; they are kept in memory (a ``RowStore``) or streamed to ``log_dir`` by the
:class:`~gradscope.recorder.rows.outlet.Outlet`. A checkpoint (``state_dict``) also holds
the cosine sampler's generator and the spike windows, so a resumed run samples and judges
as the uninterrupted one would.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import torch

from gradscope.io import save_frame
from gradscope.recorder.numerics.collectives import gather_frame
from gradscope.recorder.rows.late_rows import LateRows
from gradscope.recorder.rows.outlet import Outlet
from gradscope.recorder.step.checks import StepChecks
from gradscope.sinks.base import RunInfo
from gradscope.table.rows import RowStore
from gradscope.table.select import step_rows_only


class RecordedTable:
    """Reading, saving and checkpointing the rows one Recorder recorded.

    Args:
        late: the queue of steps whose rows are not built yet.
        outlet: where built rows go (memory or ``log_dir``, and the sinks).
        store: the in-memory rows (used when there is no ``log_dir``).
        generator: the cosine sampler's generator (checkpointed).
        checks: the Recorder's step checks (told the last step a checkpoint holds).
        info: the run-wide columns.
        watch: the spike replay's watch (a :class:`~gradscope.recorder.replay.replay.SpikeWatch`), or None
            (checkpointed).
    """

    def __init__(self, *, late: LateRows, outlet: Outlet, store: RowStore, generator: torch.Generator,
                 checks: StepChecks, info: RunInfo, watch: Any = None) -> None:
        self._late, self._out, self._store, self._generator = late, outlet, store, generator
        self._checks, self._info, self._watch = checks, info, watch

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Recorded rows, the sampling generator's state and the spike windows, as plain
        containers and tensors (loads with ``torch.load(weights_only=True)``). With
        ``log_dir`` the rows are on disk: the sinks are flushed first, so a checkpoint taken
        now loses no recorded step if the run is killed later, and the state holds no rows."""
        self._late.drain()
        if self._out.disk is not None:
            self._out.flush()
        state = {"rows": self._store.state_dict(), "generator": self._generator.get_state()}
        if self._out.spikes is not None:  # the spike quantity's windows, and the replay watch's
            state["spike"] = self._out.spikes.state_dict()
        if self._watch is not None:
            state["watch"] = self._watch.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` saved (e.g. when resuming from a checkpoint);
        rows a Recorder kept in memory go to this one's ``log_dir`` if it has one."""
        rows = RowStore()
        rows.load_state_dict(state["rows"])
        if self._out.disk is None:
            self._store.load_state_dict(state["rows"])
        elif len(rows):
            self._out.disk.adopt(rows)
        self._generator.set_state(state["generator"])
        if self._out.spikes is not None and "spike" in state:
            self._out.spikes.load_state_dict(state["spike"])
        if self._watch is not None and "watch" in state:
            self._watch.load_state_dict(state["watch"])
        steps = rows.steps()
        self._checks.resume(max(steps) if steps else None)

    # -- output ----------------------------------------------------------------------------
    def frame(self, *, gather: bool = False, dst: int = 0, micro_steps: bool = False) -> pd.DataFrame | None:
        """:meth:`gradscope.Recorder.frame`."""
        if gather:
            return gather_frame(self.frame(micro_steps=micro_steps), dst=dst)
        self._late.drain()
        disk = self._out.frame()  # with log_dir: the parts written so far and the buffer
        info = self._info
        df = disk if disk is not None else self._store.frame(run=info.run, variant=info.variant, rank=info.rank,
                                                             reduction=info.reduction)
        return df if micro_steps else step_rows_only(df)

    def save(self, path, *, gather: bool = False, dst: int = 0) -> None:
        """:meth:`gradscope.Recorder.save`: every row, micro-steps' too."""
        df = self.frame(gather=gather, dst=dst, micro_steps=True)
        if df is not None:
            save_frame(df, path)

    def flush(self) -> None:
        """Writes what the sinks buffer (a part file for ``log_dir``, pending tracker rows) now."""
        self._late.drain()
        self._out.flush()

    @property
    def rows_in_memory(self) -> int:
        """Rows kept in memory (none beyond a flush buffer with ``log_dir``)."""
        self._late.drain()
        return len(self._store)
