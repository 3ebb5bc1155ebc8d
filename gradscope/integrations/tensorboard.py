"""Writes the tidy table as TensorBoard scalars (readable by TensorBoard and tbparse).

The public way to get a recording into TensorBoard, for a live recorder or a saved table::

    from gradscope.integrations.tensorboard import to_tensorboard
    to_tensorboard(rec.frame(), "runs/tb")               # or gradscope.load("runs/run.parquet")
"""

from __future__ import annotations

import os

import pandas as pd


def scalar_tag(row) -> str:
    """``quantity/site`` (``/total`` for the empty site), with ``@micro<m>`` or ``@rank<r>`` when not the whole step."""
    tag = f"{row.quantity}/{row.site or 'total'}"
    if pd.notna(row.layer_j):
        tag += f"/{int(row.layer)}_{int(row.layer_j)}"
    if row.micro_step != -1:
        tag += f"@micro{row.micro_step}"
    if row.rank:
        tag += f"@rank{row.rank}"
    return tag


def to_tensorboard(df: pd.DataFrame, log_dir: str | os.PathLike) -> int:
    """Writes every row as a scalar ``tag = scalar_tag(row)`` at ``global_step = step``.

    Args:
        df: a gradscope table (``rec.frame()``, ``gradscope.load(path)``).
        log_dir: TensorBoard run folder (created).

    Returns:
        The number of scalars written.
    """
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(log_dir))
    try:
        for row in df.itertuples(index=False):
            writer.add_scalar(scalar_tag(row), float(row.value), global_step=int(row.step))
    finally:
        writer.close()
    return len(df)
