"""Saving and loading the tidy table: parquet, written atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from gradscope.table import COLUMNS, DTYPES

FORMAT_KEY = b"gradscope.format"
FORMAT_VERSION = b"1"


def atomic_write(path: str | os.PathLike, write) -> Path:
    """Calls ``write(tmp_path)`` on a temporary file next to ``path``, then renames it.

    A crash or an exception leaves either the old file or none, never half a file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, _default_mode())  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _default_mode() -> int:
    """0666 less the process umask, what ``open(path, "w")`` would have given."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def save_frame(df: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Writes a gradscope table to parquet atomically, tagged with the format version.

    Raises:
        ValueError: ``df`` lacks the canonical columns.
    """
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"save: not a gradscope table, missing columns {missing}")
    table = pa.Table.from_pandas(df[list(COLUMNS)].astype(DTYPES), preserve_index=False)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), FORMAT_KEY: FORMAT_VERSION})
    return atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def load(path: str | os.PathLike) -> pd.DataFrame:
    """Reads a table written by ``Recorder.save`` / ``save_frame``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not readable parquet (truncated, corrupt) or not a gradscope
            table; the message names the file and what is wrong.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"gradscope.load: no such file: {path}")
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for corrupt files
        raise ValueError(f"gradscope.load: {path} is not a readable parquet file ({type(err).__name__}: {err})") from err
    if (table.schema.metadata or {}).get(FORMAT_KEY) is None:
        raise ValueError(f"gradscope.load: {path} is parquet but not a gradscope table (no {FORMAT_KEY.decode()} tag)")
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"gradscope.load: {path} lacks columns {missing}")
    return table.to_pandas()[list(COLUMNS)].astype(DTYPES)
