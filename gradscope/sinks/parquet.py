"""A run on disk: an append-only parquet dataset, and reading one or many back.

``Recorder(model, log_dir="runs/exp1", flush_every=100)`` keeps at most ``flush_every``
recorded steps in memory; then they become one *part file*
``runs/exp1/part-r<rank>-<first step>-<last step>-<random>.parquet``, written to a hidden
temporary file, fsync'ed and renamed, so a reader (or a run killed at any moment) sees
whole part files or none. Parts are never rewritten. Every part has the table's columns (docs/table.md) with
the pyarrow types of :data:`SCHEMA` (those of the in-memory ``rec.frame()``) and the
``gradscope.format`` tag of :mod:`gradscope.table.parquet`.

Reading: :func:`read` (``gradscope.load(directory)``) reads every part below a folder, so
``gradscope.load("runs/")`` gives all runs in one frame, told apart by the ``run`` column.
A run larger than memory is queried with :func:`open_dataset`, a ``pyarrow.dataset``
whose filters and column choices are applied file by file (row groups are skipped on their
statistics), or with ``read(path, columns=..., filter=...)``, which does the same with a
progress bar.

Why pyarrow datasets rather than DuckDB: pyarrow is already a dependency (parquet is how
gradscope writes), its dataset reads exactly the files written here with the same types,
and the queries a run needs (choose quantities and sites, then a group-by over a few
million rows) are a filter and a projection pushed into the scan. DuckDB would add a
second engine, SQL strings and a second type mapping for no query we need; it still reads
these files as they are (``duckdb.sql("select ... from 'runs/*/*.parquet'")``).
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds

from gradscope.sinks.base import RunInfo, Sink
from gradscope.table import COLUMNS, DTYPES, empty_frame
from gradscope.table.keys import Key
from gradscope.sinks.last_writes import Part, last_writes
from gradscope.user_frames import user_stacklevel
from gradscope.table.parquet import (BEGUN_KEY, SCHEMA, SESSION_KEY, WRITTEN_KEY, legacy_roles, require_tag, to_arrow,
                                     unreadable, write_part)
from gradscope.table.rows import RowStore

class ParquetSink(Sink):
    """Streams a run's rows to an append-only parquet dataset in ``log_dir``.

    Args:
        log_dir: the run's folder (created). Several runs may share a parent folder;
            several ranks, or a resumed run, may share ``log_dir`` (part names never clash).
        flush_every: recorded steps kept in memory before they are written as one part
            file (default 100). A run killed without warning loses at most this many
            recorded steps; a run that ends normally, or whose Recorder is closed, loses
            none (the buffer is flushed on ``close()`` and at interpreter exit).
    """

    keeps_rows = True

    def __init__(self, log_dir: str | os.PathLike, *, flush_every: int = 100) -> None:
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"flush_every: must be an integer >= 1, got {flush_every!r}")
        self.log_dir = Path(log_dir)
        self.flush_every = flush_every
        self.written: list[Path] = []
        self._earlier: list[Path] = []  # this rank's parts already in log_dir when the sink opened
        self._buffer = RowStore()
        self._recorded = 0  # recorded steps in the buffer
        self._on_disk: int | None = None  # the last step earlier runs wrote to log_dir for this rank
        self._closed = False
        self._session = ""  # this sink's session (SESSION_KEY), set when it opens
        self._begun: set[int] = set()  # steps begun since the last part was written (BEGUN_KEY)
        self._ending = False  # closing or at exit: a part of no rows is written for steps run but not recorded

    def open(self, info: RunInfo) -> None:
        super().open(info)
        if self.log_dir.exists() and not self.log_dir.is_dir():
            raise NotADirectoryError(f"log_dir: {self.log_dir} exists and is not a folder")
        try:  # (a folder that cannot be written would fail only at the first flush, steps later)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.log_dir, prefix=".gradscope-write-check-"):
                pass
        except OSError as e:
            raise OSError(e.errno, f"log_dir: cannot write into {self.log_dir}: {e.strerror or e}") from e
        self._session = f"{time.time_ns():020d}-{secrets.token_hex(4)}"
        self._on_disk = _last_step_on_disk(self.log_dir, info.rank)
        self._earlier = sorted(self.log_dir.glob(f"part-r{info.rank}-*.parquet"))  # a run resumed into log_dir
        atexit.register(self._flush_at_exit)

    def begin(self, step: int) -> None:
        if self._on_disk is not None and step <= self._on_disk:
            warnings.warn(f"gradscope: step {step} is already in {self.log_dir} (an earlier run of rank {self.info.rank} "
                          f"wrote steps up to {self._on_disk}): a resumed run writes it again, and gradscope.load keeps "
                          "this newest write of each step; the earlier run's steps this one does not reach stay, so a "
                          "new run (not a resumed one) wants a log_dir of its own", stacklevel=_user_stacklevel())
            self._on_disk = None  # said once
        if self._recorded >= self.flush_every:
            self.flush()
        self._recorded += 1
        self._begun.add(step)

    def ran(self, step: int) -> None:
        """A step this session ran without recording it: it owns the step all the same, so an
        abandoned run's rows of it (a spike replay the resumed run did not need) are not read
        back (gradscope/sinks/last_writes.py)."""
        self._begun.add(step)

    def writes_part_at(self, waiting: int) -> bool:
        """Whether :meth:`begin` writes a part next, once ``waiting`` more step starts came."""
        return self._recorded + waiting >= self.flush_every

    def append(self, step: int, keys: list[Key], values: np.ndarray) -> None:
        if self._closed:
            raise RuntimeError(f"ParquetSink({self.log_dir}): closed; rows of step {step} cannot be written")
        self._buffer.append(step, keys, values)

    def pending(self) -> pd.DataFrame:
        """The buffered rows, not yet on disk, as a table: each (step, quantity) from its last
        write, as ``gradscope.load`` keeps them across parts (:meth:`RowStore.newest_writes`)."""
        return self._buffer.newest_writes().frame(**vars(self.info))

    def flush(self) -> None:
        """Writes the buffered rows as one part file (nothing when the buffer is empty)."""
        if self.info is None or not (len(self._buffer) or self._begun and self._ending):
            return  # (steps run without rows wait for a part with rows, or for the end: a checkpoint's flush writes none)
        steps = self._buffer.steps() or sorted(self._begun)  # (no rows: a part of no rows says which steps it ran)
        table = to_arrow(self.pending())
        table = table.replace_schema_metadata({**table.schema.metadata, WRITTEN_KEY: str(time.time_ns()).encode(),
                                               SESSION_KEY: self._session.encode(),
                                               BEGUN_KEY: json.dumps({"run": self.info.run, "rank": self.info.rank,
                                                                      "ranges": step_ranges(self._begun)}).encode()})
        name = f"part-r{self.info.rank}-{min(steps):010d}-{max(steps):010d}-{secrets.token_hex(4)}.parquet"
        try:
            self.written.append(write_part(table, self.log_dir / name))
        except OSError as e:  # (disk full, folder gone or made read-only: the rows stay buffered for a later flush)
            raise OSError(e.errno, f"gradscope: writing steps {min(steps)}-{max(steps)} to log_dir {self.log_dir} "
                                   f"failed ({e.strerror or e}); they stay in memory and are written at the next flush "
                                   "once the cause is gone (rec.flush())") from e
        self._buffer, self._recorded, self._begun = RowStore(), 0, set()

    def close(self) -> None:
        if self._closed:
            return
        self._ending = True
        self.flush()
        self._closed = True
        atexit.unregister(self._flush_at_exit)

    def _flush_at_exit(self) -> None:
        self._ending = True
        self.flush()

    def frame(self) -> pd.DataFrame:
        """This rank's rows in ``log_dir`` so far, as ``rec.frame()`` gives them: the parts an
        earlier run of it left there (a run resumed into its folder), the parts this sink
        wrote, then the buffer; each (step, quantity) from its newest write, as
        ``gradscope.load`` reads it (a row logged later for a flushed step adds to it)."""
        files = self._earlier + self.written
        parts = [read(files)] if files else []
        if parts and self._begun:  # (a step this session began or ran and has not written yet is its own whole,
            parts[0] = parts[0][~parts[0]["step"].isin(list(self._begun))]  # as load reads it)
        if self.info is not None and len(self._buffer):
            pending = self.pending()
            if parts:  # the buffer is the newest write of its (run, step, quantity)s, as load reads them
                key = ["run", "step", "quantity"]
                newer = pd.MultiIndex.from_frame(pending[key].drop_duplicates())
                parts[0] = parts[0][~pd.MultiIndex.from_frame(parts[0][key]).isin(newer)]
            parts.append(pending)
        return pd.concat(parts, ignore_index=True).astype(DTYPES) if parts else empty_frame()

    def adopt(self, rows: RowStore) -> None:
        """Takes rows recorded elsewhere (a checkpoint of a Recorder that kept them in memory)
        into the buffer: they are written with the next part."""
        if len(self._buffer):
            self.flush()
        self._buffer, self._recorded = rows, len(rows.steps())
        self._begun = set(rows.steps())  # (recorded by the run this sink continues)


def step_ranges(steps: set[int]) -> list[list[int]]:
    """``steps`` as sorted inclusive ``[first, last]`` runs (a part's BEGUN_KEY: with every=1000
    a list of every step run made a 100-row part 1.9 MB of metadata)."""
    runs: list[list[int]] = []
    for s in sorted(steps):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return runs


def begun_steps(raw: bytes) -> dict:
    """A part's BEGUN_KEY as ``{"run", "rank", "steps"}`` (written as ``ranges``; older parts list ``steps``)."""
    begun = json.loads(raw)
    if "ranges" in begun:
        begun["steps"] = [s for lo, hi in begun.pop("ranges") for s in range(lo, hi + 1)]
    return begun


def _user_stacklevel() -> int:
    """:func:`gradscope.user_frames.user_stacklevel`, from this module's caller."""
    return user_stacklevel() - 1  # (one frame more than a direct call: this one)


def _last_step_on_disk(log_dir: Path, rank: int) -> int | None:
    """The last step of the part files already in ``log_dir`` for ``rank`` (read from their
    names, ``part-r<rank>-<first>-<last>-<random>.parquet``), or None."""
    last = None
    for p in log_dir.glob(f"part-r{rank}-*.parquet"):
        fields = p.stem.split("-")
        if len(fields) == 5 and fields[3].isdigit():
            last = max(int(fields[3]), last if last is not None else int(fields[3]))
    return last


def part_files(path: str | os.PathLike) -> list[Path]:
    """Every parquet file at or below ``path``, sorted, skipping hidden and ``_``-prefixed
    names (temporary files of writes in progress, ``_SUCCESS``-style markers)."""
    path = Path(path)
    if path.is_file():
        return [path]
    found = []
    for p in path.rglob("*.parquet"):
        if not any(part.startswith((".", "_")) for part in p.relative_to(path).parts):
            found.append(p)
    return sorted(found)


def open_dataset(path: str | os.PathLike | list) -> ds.Dataset:
    """A ``pyarrow.dataset`` over every part below ``path`` (a run, a folder of runs, a file
    or a list of files), with :data:`SCHEMA`; nothing is read until it is scanned.

    Example, the decoder's layer-output gradients of a run larger than memory:

        import pyarrow.dataset as ds
        d = open_dataset("runs/")
        t = d.to_table(columns=["run", "step", "layer", "value"],
                       filter=(ds.field("quantity") == "act_grad_norm") & (ds.field("role") == "layer_out"))

    Raises:
        FileNotFoundError: no parquet file there.
    """
    files = [Path(p) for p in path] if isinstance(path, list) else part_files(path)
    if not files:
        raise FileNotFoundError(f"gradscope: no parquet files at or below {path}")
    return ds.dataset([str(f) for f in files], format="parquet", schema=SCHEMA)


def read(path: str | os.PathLike | list, *, columns: list[str] | None = None, filter: ds.Expression | None = None,
         progress: bool = False) -> pd.DataFrame:
    """Reads the parts at or below ``path`` into one table, file by file.

    Args:
        path: a run folder, a folder of runs, one file, or a list of files.
        columns: columns to read (default: all, in the table's column order).
        filter: a ``pyarrow.dataset`` expression applied while reading
            (``ds.field("quantity") == "act_grad_norm"``).
        progress: show a progress bar over the files.

    Returns:
        The rows, with the dtypes of ``rec.frame()``. A (run, rank, step, quantity) found
        in several parts of one ``log_dir`` (a run resumed from a checkpoint into its own
        folder writes again the steps it had flushed after that checkpoint) is read from the
        newest part only: the last write wins. Runs in different folders or files are all
        read, also under one run name (with a warning). Parts written before the ``role`` column existed get it
        from :func:`gradscope.table.parquet.legacy_roles`.

    Raises:
        FileNotFoundError: no parquet file there.
        ValueError: a file is unreadable or not a gradscope table (the message names it).
    """
    from tqdm.auto import tqdm

    dataset = open_dataset(path)
    columns = list(columns or COLUMNS)
    unknown = sorted(set(columns) - set(COLUMNS))
    if unknown:
        raise ValueError(f"gradscope.sinks.parquet.read: unknown column(s) {unknown}; the columns are {list(COLUMNS)}")
    reading = columns + [c for c in ("run", "rank", "step", "quantity") if c not in columns]  # (what last writes need)
    parts, legacy = [], False
    for fragment in tqdm(dataset.get_fragments(), total=len(dataset.files), desc="reading parts", unit="file",
                         disable=not progress, leave=False):
        try:
            schema = fragment.physical_schema
        except Exception as err:  # pyarrow raises several types for corrupt files
            raise unreadable(fragment.path, err) from err
        try:
            table = fragment.to_table(schema=SCHEMA, columns=reading, filter=filter)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as err:  # (the file is fine: the filter is not)
            raise ValueError(f"gradscope.sinks.parquet.read: the filter {filter} cannot be applied to the table's "
                             f"columns {list(COLUMNS)}: {err}") from err
        except Exception as err:
            raise unreadable(fragment.path, err) from err
        require_tag(schema, fragment.path)
        legacy |= "role" not in schema.names
        meta = schema.metadata or {}
        stamp = meta.get(WRITTEN_KEY)
        begun = meta.get(BEGUN_KEY)
        parts.append(Part(table, int(stamp) if stamp is not None else os.stat(fragment.path).st_mtime_ns,
                          str(Path(fragment.path).parent) if stamp is not None else fragment.path,  # a log_dir, or a file
                          meta.get(SESSION_KEY, b"").decode(), begun_steps(begun) if begun is not None else None))
    df = last_writes(parts)[reading]
    if legacy and {"role", "quantity", "site", "stack", "layer", "variant"} <= set(columns):
        missing = df["role"].isna()
        df.loc[missing, "role"] = legacy_roles(df[missing].astype({c: DTYPES[c] for c in df.columns}))
    return df[columns].astype({c: DTYPES[c] for c in columns})
