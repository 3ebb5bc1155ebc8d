"""``python -m gradscope report RUN_DIR --out DIR``: figures and a markdown summary of a run.

Reads a run streamed with ``Recorder(log_dir=RUN_DIR)`` (or a folder of runs, or a saved
table) without loading it whole: only the rows the report needs are read, file by file,
behind a progress bar (:func:`gradscope.sinks.parquet.read`). Writes, per run:

- ``<run>_heatmap.png``: ``act_grad_norm`` at every layer output × step, log colour, with
  each step's first non-finite site starred (:func:`gradscope.plots.over_time.layer_heatmap`);
- ``<run>_series.png``: the bottom, middle and top layer of each stack over steps, spikes
  marked (:func:`gradscope.plots.over_time.layer_series`);
- ``<run>_moe.png`` / ``<run>_outliers.png``, only when the run has rows of the ``moe`` /
  ``outliers`` sets (:data:`SETS`; :mod:`gradscope.plots.quantity_sets`);
- ``summary.md``: vanishing or exploding stacks at the first and last step (the scan's rule,
  :mod:`gradscope.scan`: bottom/top layer-output gradient below 0.1 or above 10), spikes
  grouped by step ("step 90: all 49 layer outputs"), the steps the rule could not judge,
  the first non-finite site, the signals, and the MoE and outlier sections.

Spikes are the run's recorded ``spike`` rows when it has any, else :func:`find_spikes` on
the layer-output series read here (the same rule: :mod:`gradscope.recorder.quantities.spike`,
median/MAD of log values, which an early transient does not blind).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.dataset as ds

from gradscope.recorder.quantities.spike import RULE, WINDOW, find_spikes, first_judged_step, too_few_for_spikes
from gradscope.plots.quantity_sets import EXPERT_LOAD, MOE_QUANTITIES, OUTLIER_QUANTITIES
from gradscope.scan import DECAY_EXPLODING, DECAY_VANISHING, GRAD_RMS_OVER_EPS_LOW
from gradscope.table import PARAM_ROLES, ROLES
from gradscope.sinks.parquet import read

LOGIT_GROWTH = 10.0  # the largest attention logit growing more than this from the first recorded step: a warning
READ_COLUMNS = ["run", "variant", "step", "micro_step", "rank", "stack", "layer", "site", "quantity", "value", "reduction",
                "role", "layer_j"]
LAYER_ROLES = ["layer_out", "embed"]
SETS = {"Mixture of experts (routing)": ("moe", (EXPERT_LOAD, *MOE_QUANTITIES)),
        "Activation outliers": ("outliers", OUTLIER_QUANTITIES)}
"""The optional quantity sets a report draws a panel figure and summary lines for, when the
run has their rows: title → (figure name, quantities)."""
SET_QUANTITIES = [q for _, names in SETS.values() for q in names]


def read_run(path: str | Path, *, progress: bool = True) -> pd.DataFrame:
    """The rows a report needs: layer-output and embedding ``act_grad_norm``, ``spike``,
    ``loss`` (accumulated rows) and every ``nonfinite`` / ``nonfinite_grad`` row."""
    q, f = ds.field("quantity"), ds.field
    wanted = (((q == "act_grad_norm") & f("role").isin(LAYER_ROLES))
              | q.isin(["spike", "loss", "attn_logit_max", "grad_rms_over_eps", *SET_QUANTITIES])) & (f("micro_step") == -1)
    return read(path, columns=READ_COLUMNS, filter=wanted | q.isin(["nonfinite", "nonfinite_grad"]), progress=progress)


def decay_lines(rows: pd.DataFrame, step: int) -> list[str]:
    """One line per stack: bottom/top layer-output gradient at ``step`` and the scan's verdict."""
    at = rows[(rows.step == step) & (rows.quantity == "act_grad_norm") & (rows.role == "layer_out")]
    lines = []
    for stack, group in at.groupby("stack", sort=False):
        group = group.sort_values("layer")
        top, bottom = group.value.iloc[-1], group.value.iloc[0]
        if not (math.isfinite(top) and math.isfinite(bottom)):
            lines.append(f"- step {step}, {stack or 'blocks'}: bottom = {bottom:.3g}, top = {top:.3g} → **non-finite** "
                         "gradient, no ratio")
            continue
        ratio = bottom / top if top > 0 else math.inf
        kind = ("**vanishing** toward the bottom" if ratio < DECAY_VANISHING else
                "**exploding** (growing toward the bottom)" if ratio > DECAY_EXPLODING else "healthy (within 10× top to bottom)")
        lines.append(f"- step {step}, {stack or 'blocks'}: bottom/top = {ratio:.3g} → {kind}")
    return lines


def _spike_kinds(at: pd.DataFrame, layer_outs: int) -> str:
    """What spiked at one step, by kind: "all 49 layer outputs; 3 parameter groups"."""
    role = at.role.fillna("")
    outs = int((role == "layer_out").sum())
    # (a spike row keeps its series' role: an activation site's, or a parameter group's, "" or PARAM_ROLES; "other"
    # is both, and is counted as a parameter group, as this table did before)
    other_acts = int((role.isin(ROLES) & ~role.isin(PARAM_ROLES) & (role != "layer_out")).sum())
    params = len(at) - outs - other_acts
    parts = []
    if outs:
        parts.append(f"all {outs} layer outputs" if outs == layer_outs > 1 else
                     f"{outs} of {layer_outs} layer outputs" if layer_outs else f"{outs} layer outputs")
    if other_acts:
        parts.append(f"{other_acts} other activation site{'s' * (other_acts > 1)}")
    if params:
        parts.append(f"{params} parameter group{'s' * (params > 1)}")
    return "; ".join(parts)


def spike_table(spikes: pd.DataFrame, limit: int = 15, steps: int | None = None, layer_outs: int = 0,
                looked_from: int | None = None) -> list[str]:
    """Markdown rows: spikes grouped by step ("step 90: all 49 layer outputs").

    Args:
        spikes: spike rows.
        limit: most steps listed (those with the most spiking sites, in step order).
        steps: the longest series' length, when the caller knows it (too short a series
            says so instead of "no spikes").
        layer_outs: how many layer-output series there are (to say "all 49").
        looked_from: the first step the rule could judge (the steps before it are said
            to be unjudged rather than spike-free).
    """
    blind = f" (steps before {looked_from} not judged: the rule needs {WINDOW // 2} earlier values)" if looked_from else ""
    if spikes.empty:
        short = too_few_for_spikes(steps) if steps is not None else None
        if short or (steps is not None and looked_from is None):
            return [f"None found, but {short or 'no series had enough usable earlier values for the rule to judge'}."]
        return [f"No spikes{blind}."]
    by = spikes.groupby("step", sort=True)
    size = by.size().sort_values(ascending=False, kind="stable")
    shown = sorted(size.index[:limit].tolist())
    out = [f"{len(spikes)} spike{'s' * (len(spikes) > 1)} at {len(size)} step{'s' * (len(size) > 1)}{blind}.", "",
           "| step | what spiked | largest z | at |", "|---|---|---|---|"]
    for step in shown:
        at = by.get_group(step).sort_values("value", ascending=False)
        sites = ", ".join(f"`{x or 'total'}`" for x in at.site.head(3)) + (" …" if len(at) > 3 else "")
        out.append(f"| {step} | {_spike_kinds(at, layer_outs)} | {at.value.max():.3g} | {sites} |")
    if len(size) > limit:
        rest = size.index[limit:]
        out.append(f"\n… and {len(rest)} more steps ({int(size[rest].sum())} spikes; steps {int(min(rest))}–{int(max(rest))}).")
    return out


def signal_lines(rows: pd.DataFrame) -> list[str]:
    """Warnings from the signals before instability, when the run recorded them: the largest
    attention logit growing more than ``LOGIT_GROWTH``× from the first recorded step
    (Wortsman 2023 §3.1), and parameter groups whose gradient RMS fell below
    ``GRAD_RMS_OVER_EPS_LOW``·ε (§3.4)."""
    lines = []
    logits = rows[(rows.quantity == "attn_logit_max")]
    if "layer_j" in logits:
        logits = logits[logits.layer_j.isna()]
    if not logits.empty:
        series = logits.groupby("step").value.max().sort_index()
        first, peak = float(series.iloc[0]), float(series.max())
        grew = first > 0 and peak / first > LOGIT_GROWTH
        lines.append(f"- largest attention logit: {first:.3g} at step {int(series.index[0])}, peak {peak:.3g} at step "
                     f"{int(series.idxmax())}" + (f" — **WARNING: grew more than {LOGIT_GROWTH:g}×** (attention-logit "
                                                  "growth precedes divergence; qk_norm bounds it)" if grew else ""))
    rms = rows[(rows.quantity == "grad_rms_over_eps") & (rows.value < GRAD_RMS_OVER_EPS_LOW)]
    if not rms.empty:
        sites = ", ".join("`" + (x or "total") + "`" for x in sorted(rms.site.unique())[:5])
        lines.append(f"- **WARNING: gradient RMS below {GRAD_RMS_OVER_EPS_LOW:g}·ε** in {rms.site.nunique()} parameter group(s) "
                     f"from step {int(rms.step.min())}: {sites} (Adam's updates shrink)")
    return lines


def first_nonfinite(rows: pd.DataFrame) -> str:
    """The first step with a NaN/Inf and where it appeared first."""
    bad = rows[rows.quantity.isin(["nonfinite", "nonfinite_grad"])]
    if bad.empty:
        return "None: every recorded value was finite."
    step = int(bad.step.min())
    first = bad[bad.step == step].assign(bwd=lambda d: d.quantity != "nonfinite").sort_values(["bwd", "micro_step", "value"]).iloc[0]
    where = "forward activation" if first.quantity == "nonfinite" else "gradient (no forward value was non-finite)"
    return f"Step {step}: first at `{first.site}` ({where}; {len(bad[bad.step == step])} non-finite sites that step)."


def report_run(rows: pd.DataFrame, out: Path, name: str, max_bins: int = 500) -> list[str]:
    """Figures and summary lines of one run (one rank). Returns the markdown section."""
    import matplotlib.pyplot as plt

    from gradscope.table.parquet import atomic_write
    from gradscope.plots.over_time import layer_heatmap, layer_series

    recorded = rows[rows.quantity == "spike"]
    layer_rows = rows[rows.quantity == "act_grad_norm"]
    spikes = recorded if not recorded.empty else find_spikes(layer_rows)
    source = "recorded `spike` rows" if not recorded.empty else "computed here from the layer-output series"
    outs = layer_rows[layer_rows.role == "layer_out"]
    variant = rows.variant.dropna().iloc[0] if rows.variant.notna().any() else "?"
    lines = [f"## run `{name}` ({variant})", ""]
    if outs.empty:
        return lines + ["No layer-output `act_grad_norm` rows: nothing to draw.", ""]
    steps = outs.step.unique()
    lines += [f"{len(steps)} recorded steps, {int(steps.min())}–{int(steps.max())}.", "",
              "### Gradient flow (the scan's rule: bottom/top layer-output ‖∂L/∂y‖ "
              f"below {DECAY_VANISHING} vanishing, above {DECAY_EXPLODING} exploding)", ""]
    lines += decay_lines(outs, int(steps.min())) + decay_lines(outs, int(steps.max())) + [""]
    lines += [f"### Spikes ({RULE}; {source})", ""]
    lines += spike_table(spikes, steps=len(steps), layer_outs=outs.site.nunique(), looked_from=first_judged_step(outs))
    lines += ["", "### First non-finite value", "", first_nonfinite(rows), ""]
    signals = signal_lines(rows)
    if signals:
        lines += ["### Signals before instability", "", *signals, ""]
    figures = []
    for kind, draw, size in (("heatmap", lambda ax: layer_heatmap(rows, max_bins=max_bins, ax=ax, title=f"run {name}"), (10, 5)),
                             ("series", lambda ax: layer_series(rows, spikes=spikes, ax=ax, title=f"run {name}"), (10, 4.5))):
        fig, ax = plt.subplots(figsize=size)
        draw(ax)
        fig.tight_layout()
        path = out / f"{_safe(name)}_{kind}.png"
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
        plt.close(fig)
        figures.append(f"![{kind}]({path.name})")
    for heading, (kind, names) in SETS.items():
        section, figure = set_section(rows, names, out, f"{_safe(name)}_{kind}.png", f"run {name}")
        if section:
            lines += [f"### {heading}", "", *section, ""]
            figures.append(f"![{kind}]({figure.name})")
    return lines + ["### Figures", ""] + figures + [""]


def set_section(rows: pd.DataFrame, names: tuple[str, ...], out: Path, file: str,
                title: str) -> tuple[list[str], Path | None]:
    """The summary lines and panel figure of one optional quantity set (MoE, outliers):
    nothing, and no figure, when the run has none of its rows.

    Returns:
        (markdown lines, the figure's path), or ([], None).
    """
    import matplotlib.pyplot as plt

    from gradscope.plots.quantity_sets import expert_load_by_layer, present, quantity_by_site, summary_lines
    from gradscope.table.parquet import atomic_write

    found = present(rows, names)
    if not found:
        return [], None
    fig, axes = plt.subplots(len(found), 1, figsize=(9, 3.2 * len(found)), squeeze=False)
    for ax, quantity in zip(axes[:, 0], found):
        expert_load_by_layer(rows, ax=ax, title=title) if quantity == EXPERT_LOAD else quantity_by_site(rows, quantity, ax=ax, title=title)
    fig.tight_layout()
    path = out / file
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight"))
    plt.close(fig)
    return summary_lines(rows, tuple(q for q in found if q != EXPERT_LOAD)) or [f"`{EXPERT_LOAD}` per expert: see the figure."], path


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "run"


def report(path: str | Path, out: str | Path, *, progress: bool = True, max_bins: int = 500) -> Path:
    """Writes the report of the run(s) at ``path`` into ``out``; returns the summary's path.

    Raises:
        FileNotFoundError: nothing to read at ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    from gradscope.table.parquet import atomic_write

    t0 = time.perf_counter()
    rows = read_run(path, progress=progress)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# gradscope report: `{path}`", ""]
    for name, run_rows in rows.groupby("run", sort=True):
        rank = int(run_rows["rank"].min())
        if run_rows.duplicated(["rank", "step", "quantity", "site", "micro_step", "layer_j"]).any():
            lines += [f"**Run `{name}`: rows of several runs share this name** (folders of a sweep, or tables saved "
                      "with the default name), so its numbers below mix them: report each folder on its own, or give "
                      "each Recorder its own `run=`.", ""]
        note = [f"(rank {rank} of ranks {sorted(run_rows['rank'].unique().tolist())})", ""] if run_rows["rank"].nunique() > 1 else []
        lines += report_run(run_rows[run_rows["rank"] == rank], out, str(name), max_bins=max_bins) + note
    lines.append(f"_{len(rows):,} rows read in {time.perf_counter() - t0:.1f} s._")
    summary = out / "summary.md"
    atomic_write(summary, lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n"))
    return summary


def add_parser(sub) -> argparse.ArgumentParser:
    """Adds the ``report`` command to ``python -m gradscope``'s sub-parsers."""
    p = sub.add_parser("report", help="figures and a markdown summary of a run streamed with log_dir=",
                       description="Reads a run written by Recorder(log_dir=RUN_DIR) (or a folder of runs) and writes a "
                       "layer x step heatmap, a few layers' series with spikes marked, and summary.md.")
    p.add_argument("run_dir", type=Path, help="the run's folder (Recorder log_dir), a folder of runs, or a .parquet file")
    p.add_argument("--out", type=Path, default=None, help="folder for the PNGs and summary.md (default: RUN_DIR/report)")
    p.add_argument("--max-bins", type=int, default=500, help="most step columns in the heatmap (default: 500)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while reading")
    return p


def run(args: argparse.Namespace) -> int:
    """Runs the ``report`` command."""
    if not args.run_dir.exists():
        raise SystemExit(f"gradscope report: no such file or folder: {args.run_dir}")
    out = args.out or args.run_dir / "report"
    try:
        summary = report(args.run_dir, out, progress=not args.no_progress, max_bins=args.max_bins)
    except (ValueError, OSError) as err:  # (an unreadable part, a table that is not gradscope's: said in one line)
        raise SystemExit(f"gradscope report: {err}") from err
    print(summary.read_text())
    print(f"wrote {summary} and its figures")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradscope.report")
    args = add_parser(parser.add_subparsers(dest="command", required=True)).parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
