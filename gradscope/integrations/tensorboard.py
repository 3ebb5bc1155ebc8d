"""TensorBoard: the live sink, and writing a saved table.

The main path is live: ``gradscope.Recorder(model, sinks=[TensorBoardSink("runs/tb")])``
writes every row as a scalar as each step is recorded (:mod:`gradscope.sinks.tensorboard`).
For a table recorded earlier::

    from gradscope.integrations.tensorboard import to_tensorboard
    to_tensorboard(gradscope.load("runs/exp1"), "runs/tb")

Both name scalars :func:`gradscope.sinks.series_name` (``act_grad_norm/decoder.layers.3.out``).
"""

from __future__ import annotations

import os

import pandas as pd

from gradscope.sinks.base import series_name
from gradscope.sinks.tensorboard import TensorBoardSink, write_frame

__all__ = ["TensorBoardSink", "scalar_tag", "to_tensorboard"]


def scalar_tag(row) -> str:
    """The tag of a table row (a namedtuple from ``itertuples``): see :func:`gradscope.sinks.series_name`."""
    opt = lambda v: None if pd.isna(v) else int(v)
    key = (row.micro_step, row.stack, opt(row.layer), row.site, row.quantity, opt(row.layer_j), row.role)
    return series_name(key, int(row.rank))


def to_tensorboard(df: pd.DataFrame, log_dir: str | os.PathLike) -> int:
    """Writes every row of a saved table as a scalar at ``global_step = step``, as the live sink would have.

    Args:
        df: a gradscope table (``rec.frame()``, ``gradscope.load(path)``).
        log_dir: TensorBoard run folder (created).

    Returns:
        The number of scalars written.
    """
    return write_frame(df, log_dir)
