"""The parquet format of a gradscope table, in one place: tags, schema, atomic writes, checks.

Every file gradscope writes (``save_frame``, a ``log_dir`` part) carries the
``gradscope.format`` tag and the table's columns (docs/table.md) with the pyarrow types of :data:`SCHEMA`
(those of the in-memory ``rec.frame()``), and is written to a temporary file and renamed,
so a reader sees a whole file or none. :mod:`gradscope.io` (one file) and
:mod:`gradscope.sinks.parquet` (a folder of parts) read and write through this module.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from gradscope.table.schema import COLUMNS, DTYPES, ZOO_SUFFIX_ROLES, empty_frame

FORMAT_KEY = b"gradscope.format"
FORMAT_VERSION = b"1"

WRITTEN_KEY = b"gradscope.written_ns"
"""Part-file metadata: when the part was written (``time.time_ns()``); a step written twice
(a run resumed into its own ``log_dir``) is read from the newest part that holds it."""

SESSION_KEY = b"gradscope.session"
"""Part-file metadata: the writing sink's session (its opening ``time.time_ns()``, zero-padded,
and a random suffix): a run resumed into its ``log_dir`` is a later session."""

BEGUN_KEY = b"gradscope.begun"
"""Part-file metadata, JSON ``{"run", "rank", "ranges"}`` (older parts: ``"steps"``, a list):
the steps, as ``[first, last]`` runs, that the part's session began since its previous part,
recorded or not (the step still open when a checkpoint flushes too); for each (run, rank),
the newest session that began a step owns it (a resumed run's step replaces the abandoned
run's rows of that step, whatever their quantities)."""

SCHEMA: pa.Schema = pa.Schema.from_pandas(empty_frame(), preserve_index=False).remove_metadata()
"""The pyarrow schema of every part file: the table's columns (docs/table.md) with the types pandas gives
``rec.frame()`` (strings, int64, nullable int64 for ``layer``/``layer_j``, float64)."""


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


def unreadable(path, err: Exception) -> ValueError:
    """The error for a file pyarrow cannot read (truncated, corrupt), naming it."""
    return ValueError(f"gradscope.load: {path} is not a readable parquet file ({type(err).__name__}: {err})")


def require_tag(schema: pa.Schema, path) -> None:
    """Raises ValueError when a parquet file's ``schema`` lacks the gradscope format tag."""
    if (schema.metadata or {}).get(FORMAT_KEY) is None:
        raise ValueError(f"gradscope.load: {path} is parquet but not a gradscope table (no {FORMAT_KEY.decode()} tag)")


def to_arrow(df: pd.DataFrame) -> pa.Table:
    """A gradscope table as a pyarrow table with :data:`SCHEMA` and the format tag."""
    table = pa.Table.from_pandas(df[list(COLUMNS)].astype(DTYPES), preserve_index=False)
    if table.schema.remove_metadata() != SCHEMA:
        table = table.cast(SCHEMA.with_metadata(table.schema.metadata))
    return table.replace_schema_metadata({**(table.schema.metadata or {}), FORMAT_KEY: FORMAT_VERSION})


def write_part(table: pa.Table, path: Path) -> Path:
    """Writes ``table`` to ``path`` atomically: hidden temporary file, fsync, rename."""
    def write(tmp: str) -> None:
        pq.write_table(table, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename must not reach the disk before the data
        finally:
            os.close(fd)

    return atomic_write(path, write)


# -- LEGACY: tables written before the ``role`` column -----------------------------------------
# frozen: the quantities of tables written before the role column (new quantities never need a legacy role)
_SITE_QUANTITIES = ("act_grad_norm", "act_norm", "nonfinite", "nonfinite_grad")
_GROUP_QUANTITIES = ("param_grad_norm", "update_ratio", "grad_rms_over_eps")


def legacy_roles(df: pd.DataFrame) -> pd.Series:
    """LEGACY: the ``role`` of each row of a table saved without a ``role`` column.

    Only for old files (the parquet tables committed under ``figures/`` before the column
    existed); :func:`load` calls it once when the column is missing. New tables carry the
    role that ``gradscope.recorder.discovery.layout`` decided when recording, and nothing else may
    derive a role from a site name. This function reads names the way that layout named
    them at the time:

    - rows of quantities that are not at a site (``ln_gain``, ``cosine``, ``loss``...):
      ``""``; parameter groups ``""`` too, but a zoo model's ``<stack>.embed`` and
      ``<stack>.final_norm`` groups: ``embedding`` and ``final_norm``;
    - ``<stack>.layers.<i>.in`` / ``.out`` (zoo) and ``<stack>.<i>.in`` / ``.out`` (blocks
      of other models), with ``stack`` and ``layer = i + 1`` from the row: ``layer_in`` /
      ``layer_out``;
    - ``memory.*``: ``memory``; zoo suffixes ``final_norm.in``, ``norm.in``, ``embed.out``,
      ``combine.out``, ``.branch``, ``.sum`` ...: their roles;
    - other ``*.in`` / ``*.out`` sites of a model that is not a zoo variant (its norms):
      ``norm_in`` / ``norm_out`` (also for its final norm, which the recorder now calls
      ``final_norm_in`` / ``final_norm_out``: a name does not tell it); anything else: ``other``.

    A ``#k`` call suffix (a module called several times) is ignored.

    Args:
        df: a table with every column but ``role``.

    Returns:
        The roles, aligned with ``df``'s index.
    """
    from gradscope.models import VARIANTS

    keys = ["quantity", "site", "stack", "layer", "variant"]
    found = df[keys].drop_duplicates()  # a few hundred distinct sites, however long the table
    found["role"] = [
        _legacy_role(str(site), str(stack), None if pd.isna(layer) else int(layer), str(variant) in VARIANTS)
        if quantity in _SITE_QUANTITIES else _legacy_group_role(str(site), quantity, str(variant) in VARIANTS)
        for quantity, site, stack, layer, variant in found.itertuples(index=False, name=None)
    ]
    return df[keys].merge(found, on=keys, how="left")["role"].set_axis(df.index).astype("string")


def _legacy_group_role(site: str, quantity: str, zoo: bool) -> str:
    """A zoo parameter group's role (``<stack>.embed``, ``<stack>.final_norm``), as the layout gives it now."""
    if not zoo or quantity not in _GROUP_QUANTITIES:
        return ""
    return "embedding" if site.endswith(".embed") else "final_norm" if site.endswith(".final_norm") else ""


def _legacy_role(site: str, stack: str, layer: int | None, zoo: bool) -> str:
    name = re.sub(r"#\d+$", "", site)
    if layer is not None and layer >= 1:
        for end, role in (("in", "layer_in"), ("out", "layer_out")):
            if name in (f"{stack}.layers.{layer - 1}.{end}", f"{stack}.{layer - 1}.{end}"):
                return role
    if name.startswith("memory."):
        return "memory"
    combine_norm = re.search(r"\.combine\.norms\.\d+\.(in|out)$", name)  # DLCL's per-layer norms
    if combine_norm:
        return f"norm_{combine_norm[1]}"
    for suffix, role in ZOO_SUFFIX_ROLES:
        if name.endswith(suffix):
            return role
    if not zoo and name.endswith((".in", ".out")):
        return "norm_in" if name.endswith(".in") else "norm_out"
    return "other"
