"""What a Recorder recorded, read back, saved and checkpointed: the table side of
:class:`~gradscope.recorder.recorder.Recorder`, which it inherits.

The rows of recorded steps wait in the Recorder's :class:`~gradscope.recorder.rows.late_rows.LateRows`
(``_late``) until read; they are kept in memory (``_store``) or streamed to ``log_dir`` by its
:class:`~gradscope.recorder.rows.outlet.Outlet` (``_out``). A checkpoint (``state_dict``) also holds
the cosine sampler's generator and the spike windows, so a resumed run samples and judges
as the uninterrupted one would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from gradscope.table.rows import RowStore

if TYPE_CHECKING:
    import torch

    from gradscope.recorder.step.checks import StepChecks
    from gradscope.recorder.rows.late_rows import LateRows
    from gradscope.recorder.rows.outlet import Outlet
    from gradscope.recorder.replay.replay import SpikeWatch


class RecordedTable:
    """Reading, saving and checkpointing the rows a Recorder recorded."""

    _late: LateRows
    _out: Outlet
    _store: RowStore
    _generator: torch.Generator
    _checks: StepChecks
    run_name: str
    variant: str
    rank: int
    reduction: str
    watch: SpikeWatch | None

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
        if self.watch is not None:
            state["watch"] = self.watch.state_dict()
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
        if self.watch is not None and "watch" in state:
            self.watch.load_state_dict(state["watch"])
        steps = rows.steps()
        self._checks.last_recorded = max(steps) if steps else None

    # -- output ----------------------------------------------------------------------------
    def frame(self, *, gather: bool = False, dst: int = 0) -> pd.DataFrame | None:
        """Everything recorded so far as the tidy table (docs/table.md).

        Args:
            gather: collect every rank's rows on rank ``dst``
                (:func:`gradscope.distributed.gather_frame`). Collective: every rank must
                call it; the other ranks get None.
            dst: the rank that receives the gathered table.
        """
        if gather:
            from gradscope.recorder.numerics.collectives import gather_frame
            return gather_frame(self, dst=dst)
        self._late.drain()
        disk = self._out.frame()  # with log_dir: the parts written so far and the buffer
        return disk if disk is not None else self._store.frame(run=self.run_name, variant=self.variant, rank=self.rank,
                                                               reduction=self.reduction)

    def save(self, path, *, gather: bool = False, dst: int = 0) -> None:
        """Writes ``frame()`` to a parquet file atomically (see ``gradscope.io``).

        With ``gather=True`` every rank must call it; rank ``dst`` writes all ranks' rows
        and the others write nothing.
        """
        from gradscope.io import save_frame
        df = self.frame(gather=gather, dst=dst)
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
