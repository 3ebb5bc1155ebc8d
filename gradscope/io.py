"""Saving and loading the tidy table: one parquet file, or a folder of them.

The format itself (tag, schema, atomic writes, the checks a reader makes) is
:mod:`gradscope.table.parquet`; a folder of part files is read by
:func:`gradscope.sinks.parquet.read`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from gradscope.sinks.parquet import read
from gradscope.table import COLUMNS, DTYPES, validate
from gradscope.table.select import step_rows_only
from gradscope.table.parquet import (  # noqa: F401  (FORMAT_*, atomic_write, legacy_roles: their old home)
    FORMAT_KEY,
    FORMAT_VERSION,
    atomic_write,
    legacy_roles,
    require_tag,
    to_arrow,
    unreadable,
)

PARQUET_SUFFIXES = (".parquet", ".pq")


def save_frame(df: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Writes a gradscope table to parquet atomically, tagged with the format version.

    Raises:
        ValueError: ``df`` lacks the canonical columns, or ``path`` names another format
            (``run.csv``: write CSV with ``df.to_csv``; this writes parquet only).
    """
    suffix = Path(path).suffix.lower()
    if suffix not in PARQUET_SUFFIXES:
        raise ValueError(f"save: {path} would be parquet under a {suffix or 'missing'} suffix; name it *.parquet "
                         f"(valid: {', '.join(PARQUET_SUFFIXES)}), or write CSV yourself with rec.frame().to_csv(path)")
    validate(df.columns, source="save")
    table = to_arrow(df)
    return atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def load(path: str | os.PathLike, *, micro_steps: bool = False) -> pd.DataFrame:
    """Reads a table written by ``Recorder.save`` / ``save_frame``, or a folder of them: one
    row per step and point, the step's value (``micro_steps=True``: also the rows of each
    micro-batch of an accumulated step, as ``Recorder.frame`` gives them).

    A folder is a run streamed with ``Recorder(log_dir=...)`` or a folder of such runs (and
    saved tables): every parquet file below it, in one frame (the ``run`` column tells
    runs apart); see :func:`gradscope.sinks.parquet.read` for reading part of a large run.
    A table written before the ``role`` column existed gets it from :func:`legacy_roles`.

    Raises:
        FileNotFoundError: no such file, or no parquet file in the folder.
        ValueError: the file is not readable parquet (truncated, corrupt) or not a gradscope
            table; the message names the file and what is wrong.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"gradscope.load: no such file: {path}")
    if path.is_dir():  # a run folder or a folder of runs: gradscope.sinks.parquet
        df = read(path)
        return df if micro_steps else step_rows_only(df)
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for corrupt files
        raise unreadable(path, err) from err
    require_tag(table.schema, path)
    validate(table.column_names, source=f"gradscope.load: {path}", optional=("role",))  # role: see legacy_roles
    df = table.to_pandas()
    if "role" not in df.columns:  # written before the role column existed
        df["role"] = legacy_roles(df)
    df = df[list(COLUMNS)].astype(DTYPES)
    return df if micro_steps else step_rows_only(df)
