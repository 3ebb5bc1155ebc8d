"""The :class:`Verdict` record, its console line, and ``figures/CLAIMS.md``."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gradscope.table.parquet import atomic_write

HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
CLAIM, CONTROL = "claim", "control"

HEADER = """# Claims checked by the analyses

Written by `gradscope.claims.write_claims`. Each `## <analysis>` section is replaced when
that analysis runs again. A rule is fixed in code before any run (`gradscope/claims/`) and
quotes the sentence of the paper it checks. Verdicts: *holds*, *does not hold*, or
*inconclusive*: the data was missing, fewer than 3 seeds ran, a run neither learned nor
failed, or the margin lies inside the spread over seeds (`gradscope.claims.seeds`). Values
are the mean over seeds ± the largest deviation of a seed from that mean. *Controls* are
checks of the method (rows the paper's own logic predicts, e.g. at init), not verdicts on
the paper.
"""

_CLAIMS_HEAD = (
    "| figure | claim | the paper says | rule | seeds | value(s) | margin | verdict | preset | detail |\n"
    "|---|---|---|---|---|---|---|---|---|---|\n"
)
_CONTROLS_HEAD = (
    "| figure | control | rule | seeds | value(s) | verdict | preset | detail |\n"
    "|---|---|---|---|---|---|---|---|\n"
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
        margin: the signed distance of the deciding number from the rule's boundary, > 0 in
            the claim's direction (e.g. ``1 - ratio`` for ``ratio < 1``); None for a rule on
            outcomes rather than a number.
        quote: the paper's section and the sentence the rule checks.
        kind: ``"claim"`` (a verdict on the paper) or ``"control"`` (a check of the method).
        seeds: how many seeds the values are over.
        spread: per value, the largest deviation of a seed from the mean (empty for one seed).
        margin_spread: the same for the margin.
    """

    figure: str
    claim: str
    metric: str
    values: Mapping[str, float] = field(default_factory=dict)
    holds: bool | None = None
    preset: str = ""
    detail: str = ""
    margin: float | None = None
    quote: str = ""
    kind: str = CLAIM
    seeds: int = 1
    spread: Mapping[str, float] = field(default_factory=dict)
    margin_spread: float | None = None

    @property
    def status(self) -> str:
        """``"holds"``, ``"does not hold"`` or ``"inconclusive"``."""
        return INCONCLUSIVE if self.holds is None else HOLDS if self.holds else FAILS


def verdict(
    figure: str, claim: str, metric: str, values: Mapping[str, float], holds: bool, *,
    preset: str, detail: str = "", require_finite: bool = True, margin: float | None = None,
) -> Verdict:
    """A measured verdict; with ``require_finite`` a non-finite value makes it inconclusive."""
    vals = {k: float(v) for k, v in values.items()}
    bad = [k for k, v in vals.items() if not math.isfinite(v)]
    margin = None if margin is None else float(margin)
    if require_finite and bad:
        return Verdict(figure, claim, metric, vals, None, preset,
                       f"non-finite {', '.join(bad)}" + (f"; {detail}" if detail else ""), margin)
    return Verdict(figure, claim, metric, vals, bool(holds), preset, detail, margin)


def inconclusive(figure: str, claim: str, metric: str, *, preset: str, detail: str) -> Verdict:
    """A verdict for missing or insufficient data."""
    return Verdict(figure, claim, metric, {}, None, preset, detail)


not_measured = inconclusive  # (the rules' older name)


def _fmt(values: Mapping[str, float], spread: Mapping[str, float] | None = None) -> str:
    spread = spread or {}
    return "; ".join(f"{k} = {v:.4g}" + (f" ± {spread[k]:.2g}" if k in spread else "")
                     for k, v in values.items()) or "—"


def _margin(v: Verdict) -> str:
    if v.margin is None:
        return "—"
    return f"{v.margin:.3g}" + (f" ± {v.margin_spread:.2g}" if v.margin_spread is not None else "")


def verdict_line(v: Verdict) -> str:
    """One console line: ``[holds] Takase 2022 Fig. 3: claim — values (preset ci)``."""
    preset = f" (preset {v.preset})" if v.preset else ""
    detail = f" [{v.detail}]" if v.detail else ""
    kind = "control: " if v.kind == CONTROL else ""
    seeds = f", {v.seeds} seeds" if v.seeds > 1 else ""
    return f"[{v.status}] {kind}{v.figure}: {v.claim} — {_fmt(v.values, v.spread)}{seeds}{preset}{detail}"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|") or "—"


def _row(cells: Iterable[object]) -> str:
    return "| " + " | ".join(_cell(str(c)) for c in cells) + " |\n"


def render_section(verdicts: Iterable[Verdict], analysis: str) -> str:
    """The markdown section of one analysis: a heading, the claims' table and, when there
    are any, the controls' table."""
    verdicts = list(verdicts)
    claims = "".join(_row((v.figure, v.claim, v.quote, v.metric, v.seeds, _fmt(v.values, v.spread), _margin(v),
                           v.status, v.preset, v.detail)) for v in verdicts if v.kind != CONTROL)
    controls = "".join(_row((v.figure, v.claim, v.metric, v.seeds, _fmt(v.values, v.spread), v.status, v.preset,
                             v.detail)) for v in verdicts if v.kind == CONTROL)
    text = f"## {analysis}\n\n"
    if claims or not controls:
        text += _CLAIMS_HEAD + claims
    if controls:
        text += ("\n" if claims else "") + "Controls (checks of the method, not verdicts on the paper):\n\n"
        text += _CONTROLS_HEAD + controls
    return text


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
