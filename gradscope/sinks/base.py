"""The interface every sink shares, and the series name a row gets in a tracker.

A *sink* receives a run's rows as they are recorded, step by step, in the form the recorder
keeps them: row keys (:class:`gradscope.table.keys.Key`) and a
float64 vector of values. The run-wide columns (``run``,
``variant``, ``rank``, ``reduction``) come once, in :class:`RunInfo`.

Order of calls, made by :class:`gradscope.sinks.Outlet` for one Recorder::

    sink.open(info)
    for each recorded step:
        sink.begin(step)                 # every earlier step's rows are complete
        sink.append(step, keys, values)  # once or more: the step's rows, then update_ratio
                                         # and anything logged with step= after the step
    sink.close()                         # flushes; also flush() at any time
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from gradscope.table.keys import Key
from gradscope.table.rows import RowStore



@dataclass(frozen=True)
class RunInfo:
    """The columns that are the same on every row of one Recorder.

    Attributes:
        run: the ``run`` column.
        variant: the ``variant`` column.
        rank: the ``rank`` column.
        reduction: the ``reduction`` column (``"mean"`` or ``"sum"``).
    """

    run: str
    variant: str
    rank: int
    reduction: str


class Sink:
    """Base class: a destination for a run's rows. Subclasses override what they need.

    A sink that *keeps* the rows (``keeps_rows``: :class:`~gradscope.sinks.parquet.ParquetSink`)
    reads them back (:meth:`frame`), so the Recorder keeps none in memory; it may also own
    the steps a session ran (:meth:`ran`), write at a step's start (:meth:`writes_part_at`)
    and take rows a checkpoint held in memory (:meth:`adopt`). A Recorder has at most one.
    """

    info: RunInfo | None = None
    keeps_rows: bool = False

    def open(self, info: RunInfo) -> None:
        """Called once, when the Recorder is made."""
        self.info = info

    def begin(self, step: int) -> None:
        """A recorded step starts: the rows of every earlier step are complete."""

    def append(self, step: int, keys: list[Key], values: np.ndarray) -> None:
        """Rows of ``step`` (one call per piece: the step's rows, update_ratio, logged scalars)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Writes whatever is buffered."""

    def close(self) -> None:
        """Flushes and releases files and handles; later calls do nothing."""
        self.flush()

    def ran(self, step: int) -> None:
        """A step that is not recorded ran (a sink that keeps rows owns it all the same)."""

    def writes_part_at(self, waiting: int) -> bool:
        """Whether :meth:`begin` writes out once ``waiting`` more step starts came (the
        Recorder then builds the rows waiting for it first)."""
        return False

    def frame(self) -> pd.DataFrame | None:
        """The rows this sink kept, as ``rec.frame()`` gives them (``keeps_rows``), else None."""
        return None

    def adopt(self, rows: RowStore) -> None:
        """Takes rows a checkpoint held in memory (``keeps_rows``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no rows")


def series_name(key: Key, rank: int = 0) -> str:
    """The name of a row's series in a tracker: ``quantity/site``.

    ``total`` stands for the empty site (model-level rows: ``loss/total``,
    ``param_grad_norm/total``); matrix rows add ``/i_j``; a row of one micro-batch adds
    ``@micro<m>`` and a non-zero rank ``@rank<r>``. Examples:
    ``act_grad_norm/decoder.layers.3.out``, ``cosine/decoder.layers/2_0``.

    Args:
        key: a row key ``(micro_step, stack, layer, site, quantity, layer_j, role)``.
        rank: the row's rank.
    """
    micro, _, layer, site, quantity, layer_j, _ = key
    name = f"{quantity}/{site or 'total'}"
    if layer_j is not None and not (isinstance(layer_j, float) and math.isnan(layer_j)):
        name += f"/{int(layer)}_{int(layer_j)}"
    if micro != -1:
        name += f"@micro{micro}"
    if rank:
        name += f"@rank{rank}"
    return name


class NameCache:
    """Series names of row keys, each computed once (a run has a few hundred distinct keys)."""

    def __init__(self) -> None:
        self._names: dict[Key, str] = {}

    def __call__(self, keys: list[Key], rank: int) -> list[str]:
        names = self._names
        out = []
        for k in keys:
            name = names.get(k)
            if name is None:
                name = names[k] = series_name(k, rank)
            out.append(name)
        return out
