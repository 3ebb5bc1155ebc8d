"""The :class:`Verdict` record, its console line, and ``figures/CLAIMS.md``."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gradscope.table.parquet import atomic_write

HOLDS, FAILS, NOT_MEASURED = "holds", "does not hold", "not measured"

HEADER = """# Claims checked by the analyses

Written by `gradscope.claims.write_claims`. Each `## <analysis>` section is replaced when
that analysis runs again. A rule is fixed in code before any run (`gradscope/claims/`);
"not measured" means the data it needs was missing or insufficient at that preset.
"""

_TABLE_HEAD = (
    "| figure | claim | rule | value(s) | verdict | preset | detail |\n"
    "|---|---|---|---|---|---|---|\n"
)


@dataclass(frozen=True)
class Verdict:
    """Outcome of one claim's decision rule.

    Attributes:
        figure: paper and figure, e.g. ``"Takase 2022 Fig. 3"``.
        claim: the claim in words.
        metric: the decision rule as a formula, with its thresholds.
        values: the deciding numbers by name (NaN allowed, e.g. a failed run's loss).
        holds: True / False, or None when the data is missing or insufficient.
        preset: analysis preset the data came from (``ci``, ``default``, ``paper``).
        detail: why the verdict is what it is, in a few words (what was missing...).
    """

    figure: str
    claim: str
    metric: str
    values: Mapping[str, float] = field(default_factory=dict)
    holds: bool | None = None
    preset: str = ""
    detail: str = ""

    @property
    def status(self) -> str:
        """``"holds"``, ``"does not hold"`` or ``"not measured"``."""
        return NOT_MEASURED if self.holds is None else HOLDS if self.holds else FAILS


def verdict(
    figure: str, claim: str, metric: str, values: Mapping[str, float], holds: bool, *,
    preset: str, detail: str = "", require_finite: bool = True,
) -> Verdict:
    """A measured verdict; with ``require_finite`` a non-finite value makes it not measured."""
    vals = {k: float(v) for k, v in values.items()}
    bad = [k for k, v in vals.items() if not math.isfinite(v)]
    if require_finite and bad:
        return Verdict(figure, claim, metric, vals, None, preset,
                       f"non-finite {', '.join(bad)}" + (f"; {detail}" if detail else ""))
    return Verdict(figure, claim, metric, vals, bool(holds), preset, detail)


def not_measured(figure: str, claim: str, metric: str, *, preset: str, detail: str) -> Verdict:
    """A verdict for missing or insufficient data."""
    return Verdict(figure, claim, metric, {}, None, preset, detail)


def _fmt(values: Mapping[str, float]) -> str:
    return "; ".join(f"{k} = {v:.4g}" for k, v in values.items()) or "—"


def verdict_line(v: Verdict) -> str:
    """One console line: ``[holds] Takase 2022 Fig. 3: claim — values (preset ci)``."""
    preset = f" (preset {v.preset})" if v.preset else ""
    detail = f" [{v.detail}]" if v.detail else ""
    return f"[{v.status}] {v.figure}: {v.claim} — {_fmt(v.values)}{preset}{detail}"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|") or "—"


def render_section(verdicts: Iterable[Verdict], analysis: str) -> str:
    """The markdown section of one analysis: a heading and a table row per verdict."""
    body = "".join(
        "| " + " | ".join(_cell(c) for c in (v.figure, v.claim, v.metric, _fmt(v.values),
                                               v.status, v.preset, v.detail)) + " |\n"
        for v in verdicts
    )
    return f"## {analysis}\n\n{_TABLE_HEAD}{body}"


def _read_sections(path: Path) -> dict[str, str]:
    """Existing ``## name`` sections of ``path`` by name (the header is regenerated)."""
    if not path.exists():
        return {}
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith("## "):
            current = sections.setdefault(line[3:].strip(), [])
        if current is not None:
            current.append(line)
    return {name: "".join(lines).rstrip("\n") + "\n" for name, lines in sections.items()}


def write_claims(verdicts: Iterable[Verdict], path: str | os.PathLike[str], *, analysis: str) -> Path:
    """Writes ``analysis``'s section of the claims file, keeping every other section.

    Sections are sorted by analysis name so the file is stable. The file is written to a
    temporary file in the same directory and moved into place with ``os.replace``, so a
    reader never sees a half-written file and no temporary file is left behind.

    Args:
        verdicts: the analysis's verdicts, in the order the rows should appear.
        path: the claims file, conventionally ``figures/CLAIMS.md``; parents are created.
        analysis: section name, e.g. ``"takase_fig3"`` (one line, no leading ``#``).

    Returns:
        The path written.

    Raises:
        ValueError: ``analysis`` is empty or spans lines.
    """
    if not analysis.strip() or "\n" in analysis:
        raise ValueError(f"analysis must be a one-line name, got {analysis!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sections = _read_sections(path)
    sections[analysis.strip()] = render_section(verdicts, analysis.strip())
    text = HEADER + "".join("\n" + sections[name] for name in sorted(sections))
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
