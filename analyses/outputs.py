"""What an analysis writes: its table, figure and verdicts, each file written atomically
(temporary file + ``os.replace``)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use(os.environ.get("MPLBACKEND") or "Agg")  # figures are only ever saved

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import gradscope  # noqa: E402
from gradscope.claims import Verdict, verdict_line, write_claims  # noqa: E402
from gradscope.io import atomic_write  # noqa: E402
from gradscope.table.parquet import to_arrow  # noqa: E402


SETTING_KEY = b"analyses.setting"  # the parquet metadata that records the run's setting (--redraw checks it)


def save_table(df: pd.DataFrame, out: Path, name: str, setting: dict | None = None) -> Path:
    """The tidy table as ``out/<name>.parquet`` (as ``gradscope.save_frame``: the format tag,
    atomic), with the analysis's ``setting`` (preset, seed, flags) in its metadata."""
    if setting is None:
        return gradscope.save_frame(df, out / f"{name}.parquet")
    gradscope.table.validate(df.columns, source="save")
    table = to_arrow(df)
    table = table.replace_schema_metadata({**table.schema.metadata, SETTING_KEY: json.dumps(setting, sort_keys=True)})
    return atomic_write(out / f"{name}.parquet", lambda tmp: pq.write_table(table, tmp))


def saved_setting(path: Path) -> dict | None:
    """The setting :func:`save_table` recorded in ``path``, or None (a table saved without one)."""
    raw = (pq.read_schema(path).metadata or {}).get(SETTING_KEY)
    return None if raw is None else json.loads(raw)


def save_plain_table(df: pd.DataFrame, out: Path, name: str) -> Path:
    """A table that is not a gradscope table (a sweep summary) as parquet, atomically."""
    return atomic_write(out / f"{name}.parquet", lambda tmp: df.to_parquet(tmp, index=False))


def save_figure(fig: Figure, out: Path, name: str) -> list[Path]:
    """``out/<name>.png`` (150 dpi) and ``out/<name>.pdf``, each atomic; closes the figure."""
    paths = []
    for fmt, extra in (("png", {"dpi": 150}), ("pdf", {})):
        write = lambda tmp, f=fmt, kw=extra: fig.savefig(tmp, format=f, bbox_inches="tight", **kw)  # noqa: E731
        paths.append(atomic_write(out / f"{name}.{fmt}", write))
    plt.close(fig)
    return paths


def annotate(fig: Figure, title: str, lines: Sequence[str], verdicts: Sequence[Verdict] = ()) -> None:
    """Figure title, and a footer with the preset, the recipe and every verdict.

    A claim that does not show at this preset is written on the figure as such.
    """
    fig.suptitle(title, fontsize="large")
    footer = [*lines, *(f"[{v.status}] {'control: ' if v.kind == 'control' else ''}{v.figure}: {v.claim}"
                        for v in verdicts)]
    fig.text(0.01, -0.01, "\n".join(footer), ha="left", va="top", fontsize="small", wrap=True)


def tag(v: Verdict, setting: str) -> Verdict:
    """``v`` with its setting (``18L-18L``, ``at init``...) appended to the claim."""
    return dataclasses.replace(v, claim=f"{v.claim} ({setting})")


def report(verdicts: Sequence[Verdict], out: Path, analysis: str) -> None:
    """Prints one line per verdict and updates ``out/CLAIMS.md``'s section of ``analysis``."""
    for v in verdicts:
        print(verdict_line(v), flush=True)
    write_claims(verdicts, out / "CLAIMS.md", analysis=analysis)


def publish(df: pd.DataFrame, fig: Figure, verdicts: Sequence[Verdict], out: Path, name: str,
            setting: dict | None = None) -> None:
    """Saves ``name``'s table (with ``setting`` in its metadata) and figure into ``out``, prints
    its verdicts and updates CLAIMS.md."""
    save_table(df, out, name, setting)
    save_figure(fig, out, name)
    report(verdicts, out, name)
