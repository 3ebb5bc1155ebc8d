"""A live TensorBoard sink: every row a scalar, written as the step is recorded.

    rec = gradscope.Recorder(model, sinks=[TensorBoardSink("runs/tb")])

or into a writer the training already has (Lightning's ``TensorBoardLogger(...).experiment``,
a ``SummaryWriter`` of your own): ``TensorBoardSink(writer=writer)``. Tags are
:func:`gradscope.sinks.base.series_name` (``act_grad_norm/decoder.layers.3.out``), at
``global_step`` = the recorder's step. All rows of one piece of a step go into one event
(one protobuf ``Summary`` with many values), not one event per row.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from gradscope.sinks.base import NameCache, RunInfo, Sink
from gradscope.table.keys import Key


class TensorBoardSink(Sink):
    """Writes each recorded row as a TensorBoard scalar while the run goes on.

    Args:
        log_dir: TensorBoard run folder (a ``SummaryWriter`` is made there and closed
            with the sink). Give this or ``writer``.
        writer: an open ``torch.utils.tensorboard.SummaryWriter`` (or anything with its
            ``file_writer``), left open on close.
        flush_secs: how often the writer made here flushes to disk (default 30 s).
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, *, writer=None, flush_secs: int = 30) -> None:
        if (log_dir is None) == (writer is None):
            raise ValueError("TensorBoardSink: give exactly one of log_dir and writer")
        self.log_dir, self.writer, self.flush_secs = log_dir, writer, flush_secs
        self._owns = writer is None
        self._names = NameCache()

    def open(self, info: RunInfo) -> None:
        super().open(info)
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=self.flush_secs)

    def append(self, step: int, keys: list[Key], values: np.ndarray) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        if self.writer is None:
            raise RuntimeError("TensorBoardSink: not open (or closed)")
        names = self._names(keys, self.info.rank if self.info else 0)
        summary = Summary(value=[Summary.Value(tag=n, simple_value=v) for n, v in zip(names, np.asarray(values, float).tolist())])
        self.writer._get_file_writer().add_summary(summary, int(step))  # what add_scalar calls, once per piece

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is None:
            return
        self.flush()
        if self._owns:
            self.writer.close()
            self.writer = None


def write_frame(df, log_dir: str | os.PathLike) -> int:
    """Writes a saved table (``gradscope.load(...)``) to TensorBoard, as the live sink would have.

    A table of several runs (a folder of runs loaded at once) is written one run per
    subfolder, ``log_dir/<run>``, which TensorBoard shows as runs side by side; the series of
    two runs would otherwise be one series with two values per step.

    Args:
        df: a gradscope table.
        log_dir: TensorBoard folder (created): the run's, or the parent of the runs'.

    Returns:
        The number of scalars written.
    """
    if "run" in df.columns and df["run"].nunique(dropna=False) > 1:
        return sum(write_frame(rows, Path(log_dir) / _folder_name(run)) for run, rows in df.groupby("run", sort=True))
    sink = TensorBoardSink(log_dir)
    sink.open(RunInfo(run="", variant="", rank=0, reduction=""))
    try:
        for (step, rank), rows in df.groupby(["step", "rank"], sort=True):
            sink.info = RunInfo(run="", variant="", rank=int(rank), reduction="")
            keys = list(zip(rows.micro_step.tolist(), rows["stack"].tolist(), _opt(rows.layer), rows.site.tolist(),
                            rows.quantity.tolist(), _opt(rows.layer_j), rows.role.tolist()))
            sink.append(int(step), keys, rows.value.to_numpy(float))
    finally:
        sink.close()
    return len(df)


def _folder_name(run) -> str:
    """A run's name as a folder name (path separators replaced)."""
    return str(run).replace(os.sep, "_").replace("/", "_") or "_"


def _opt(column) -> list:
    """A nullable integer column as ints and None, as row keys hold it."""
    return [None if v is pd.NA else int(v) for v in column.astype(object).tolist()]
