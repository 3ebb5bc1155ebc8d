"""Which rows of a run's part files are read: a step written again replaces what an
abandoned run wrote of it.

A run resumed from a checkpoint into its own ``log_dir`` writes again the steps it had
written after that checkpoint. Each part file records its *session* (the sink that wrote it,
ordered by when it opened) and the steps whose recording *began* in that session
(:data:`~gradscope.table.parquet.SESSION_KEY`, :data:`~gradscope.table.parquet.BEGUN_KEY`).
For every (run, rank, step) of one ``log_dir``, the newest session that began the step owns
it: the rows older sessions wrote for it go, all of them, also quantities the new session
did not write (the ``nonfinite`` or ``spike`` rows of a divergence the resumed run avoided).
Rows a session logged later for a step it did not begin (``rec.log(..., step=s)``) stay
unless an older session's. Then each (run, rank, step, quantity) is read from the newest
part that holds it. Parts written before sessions were recorded are the oldest session.

Rows of different sources (log_dirs, saved files) are all kept: two sources with one run
name and the same steps are two runs under one name, and a warning says so.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc


@dataclass
class Part:
    """One part file as read: its rows, when it was written (ns), its source (a ``log_dir``,
    or the file itself), its session ("" when not recorded) and what began in its session
    (``{"run", "rank", "steps"}``; None when not recorded)."""

    table: pa.Table
    written: int
    source: str
    session: str = ""
    begun: dict | None = None


def last_writes(parts: list[Part]) -> pd.DataFrame:
    """The parts' rows in one frame, as the module docstring says (the key columns ``run``,
    ``rank``, ``step`` and ``quantity`` must be among the tables' columns). Parts that overlap
    no other part of their source are taken whole, without a group-by (the common case: one
    run, written once)."""
    tables = [p.table for p in parts]
    key = ["run", "rank", "step", "quantity"]
    if len(parts) < 2:
        return pa.concat_tables(tables).to_pandas() if tables else pd.DataFrame()
    spans = []
    for t in tables:
        ids = set(itertools.product(*(pc.unique(t[c]).to_pylist() for c in ("run", "rank"))))
        lo_hi = pc.min_max(t["step"]).as_py() if t.num_rows else {"min": None, "max": None}
        spans.append((ids, lo_hi["min"], lo_hi["max"]))

    def overlap(a, b) -> bool:
        return a[1] is not None and b[1] is not None and bool(a[0] & b[0]) and a[1] <= b[2] and b[1] <= a[2]

    pairs = [(i, j) for i in range(len(spans)) for j in range(i + 1, len(spans)) if overlap(spans[i], spans[j])]
    sources = [p.source for p in parts]
    # (several sessions in one source: ownership comes from what began where, also for parts a
    # filter left empty or that overlap no other part after it)
    sessions_in = {}
    for p in parts:
        sessions_in.setdefault(p.source, set()).add(p.session)
    resumed = any(len(found) > 1 for found in sessions_in.values())
    clashes = sorted({(sources[i], sources[j]) for i, j in pairs if sources[i] != sources[j]})
    if clashes:
        names = sorted({str(r[0]) for i, j in pairs if sources[i] != sources[j] for r in spans[i][0] & spans[j][0]})
        warnings.warn(f"gradscope: {len(clashes)} pair(s) of runs in different places share a run name and steps "
                      f"(run {', '.join(map(repr, names[:5]))}; e.g. {clashes[0][0]} and {clashes[0][1]}): all their rows "
                      "are kept, and only their place tells them apart in the frame. Give each Recorder its own run=, "
                      "or load them one by one", stacklevel=4)
    if not resumed and not any(sources[i] == sources[j] for i, j in pairs):
        return pa.concat_tables(tables).to_pandas()
    rows = [t.num_rows for t in tables]
    source_id = np.unique(sources, return_inverse=True)[1]
    sessions = sorted({p.session for p in parts})  # ("" first: parts from before sessions were recorded)
    session_of = {s: k for k, s in enumerate(sessions)}
    df = pa.concat_tables(tables).to_pandas()
    df["_written"] = np.repeat(np.argsort(np.argsort([p.written for p in parts], kind="stable"), kind="stable"), rows)
    df["_source"] = np.repeat(source_id, rows)
    df["_session"] = np.repeat([session_of[p.session] for p in parts], rows)
    began = [(source_id[k], p.begun["run"], p.begun["rank"], session_of[p.session], step)
             for k, p in enumerate(parts) if p.begun for step in p.begun["steps"]]
    if began:  # each (run, rank, step)'s owner: the newest session that began it in that source
        at = ["_source", "run", "rank", "step"]
        began = pd.DataFrame(began, columns=["_source", "run", "rank", "_owner", "step"])
        began = began.astype({c: df[c].dtype for c in ("run", "rank", "step")})
        owner = began.groupby(at, dropna=False)["_owner"].max()
        owned = df.join(owner, on=at)["_owner"]
        df = df[owned.isna().to_numpy() | (df["_session"].to_numpy() >= owned.fillna(-1).to_numpy())]
    newest = df.groupby([*key, "_source"], dropna=False, sort=False)["_written"].transform("max")
    return df[df["_written"] == newest].drop(columns=["_written", "_source", "_session"]).reset_index(drop=True)
