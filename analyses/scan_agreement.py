"""Does the one-step scan predict which runs train? (issue 5: validating ``gradscope scan``)

For every (variant, init, depth) that ``analyses.convergence`` trains, the scan's verdict at
step 0 — "at risk" when any stack's bottom/top gradient ratio leaves [0.1, 10] or a site is
non-finite (``gradscope.scan``) — is compared with the run's outcome in
``<out>/convergence_sweep.parquet`` (learned / failed / partial, ``gradscope.claims.run_outcome``:
the one rule of every training claim). A *partial* run (left chance, did not learn) is
neither, so it is listed but not counted as agreeing or disagreeing.
Run ``analyses.convergence`` first at the same preset; ``python -m analyses`` does.

Outputs: ``scan_agreement.md`` (the table, with the counts that agree and disagree) and
``scan_agreement.parquet``.

With ``--init-only`` (a preset whose sweep cannot be trained here, e.g. ``paper`` on a CPU)
only the scan is run: the table gives each run's step-0 numbers and verdict, with no
outcome and no agreement.

    python -m analyses.scan_agreement --preset default --out figures
    python -m analyses.scan_agreement --preset paper --init-only --batch-size 64 --out figures/paper
"""

from __future__ import annotations

import sys

import pandas as pd

from analyses.convergence import Convergence
from analyses.outputs import save_plain_table
from analyses.runner import entry_point, session
from analyses.runs import Bench, build
from gradscope.io import atomic_write
from gradscope.scan import DECAY_EXPLODING, DECAY_VANISHING, summarize

NAME = "scan_agreement"
SCAN_QUANTITIES = ("act_grad_norm", "act_norm", "ln_gain", "nonfinite")


def scan_rows(specs, bench: Bench) -> pd.DataFrame:
    """One row per planned run: its step-0 scan numbers and verdict (training batch 1, before any update)."""
    rows = []
    for spec in specs:
        model = build(spec, bench.seed_of(spec), bench.device)
        result = summarize(bench.measure(model, run=spec.run, quantities=SCAN_QUANTITIES, step=0,
                                         seed=bench.seed_of(spec)))
        rows.append({"run": spec.run, "variant": spec.model.variant, "init": spec.init, "depth": spec.depth,
                     "encoder_bottom_top": result.decay.get("encoder"), "decoder_bottom_top": result.decay.get("decoder"),
                     "min_ln_gain": result.smallest_gain[1] if result.smallest_gain else None,
                     "scan": "healthy" if result.healthy else "at risk"})
    return pd.DataFrame(rows)


def agreement(scans: pd.DataFrame, sweep: pd.DataFrame) -> pd.DataFrame:
    """Scan verdicts joined with outcomes (``learned``, ``failed``, ``partial``); ``agree`` =
    (healthy and learned) or (at risk and failed), NA for a partial or undecided run."""
    outcome = sweep[["run", "converged"]].assign(
        outcome=lambda d: d.converged.map({True: "learned", False: "failed"}).fillna("partial").astype(str))
    table = scans.merge(outcome[["run", "outcome"]], on="run", how="left")
    decided = table.outcome.isin(["learned", "failed"])
    table["agree"] = ((table.scan == "healthy") == (table.outcome == "learned")).astype("boolean").where(decided, pd.NA)
    return table


def scan_markdown(table: pd.DataFrame, preset: str, notes: list[str]) -> str:
    """The step-0 scan of every planned run, without outcomes (``--init-only``), as ``scan_agreement.md``."""
    at_risk = int((table.scan == "at risk").sum())
    lines = [
        f"# Scan at step 0 (preset {preset}); training outcomes not measured", "",
        f"Written by `python -m analyses.{NAME} --init-only`: {'; '.join(notes)}. Scan verdict: *at risk* when a "
        f"stack's gradient-norm ratio bottom/top layer output leaves [{DECAY_VANISHING:g}, {DECAY_EXPLODING:g}] or a "
        "site is non-finite, else *healthy*. The runs are those `analyses.convergence` trains at this preset; "
        "they were not trained, so there is no agreement to count.", "",
        f"**{at_risk} of {len(table)} runs at risk, {len(table) - at_risk} healthy.**", "",
        "| run | encoder bottom/top | decoder bottom/top | min LN gain | scan |", "|---|---|---|---|---|",
        *(f"| {r.run} | {r.encoder_bottom_top:.3g} | {r.decoder_bottom_top:.3g} | {r.min_ln_gain:.3g} | {r.scan} |"
          for r in table.itertuples()),
    ]
    return "\n".join(lines) + "\n"


def markdown(table: pd.DataFrame, preset: str) -> str:
    """The agreement table with its counts, as ``scan_agreement.md``."""
    counts = pd.crosstab(table.scan, table.outcome).reindex(index=["healthy", "at risk"],
                                                            columns=["learned", "failed", "partial"], fill_value=0)
    decided = table.agree.notna()
    n, agree = int(decided.sum()), int(table.agree.fillna(False).astype(bool).sum())
    lines = [
        f"# Scan at step 0 vs. training outcome (preset {preset})", "",
        f"Written by `python -m analyses.{NAME}`. Scan verdict: *at risk* when a stack's gradient-norm ratio "
        f"bottom/top layer output leaves [{DECAY_VANISHING:g}, {DECAY_EXPLODING:g}] or a site is non-finite, "
        "else *healthy*. Outcome from `analyses.convergence` (`gradscope.claims.outcome`: learned = closed "
        ">= half the gap between the task's chance loss and floor; failed = diverged or stuck at chance; "
        "partial = neither, not counted).", "",
        f"**{agree} of {n} decided runs agree, {n - agree} disagree; {len(table) - n} partial.**", "",
        "| scan \\ outcome | learned | failed | partial |", "|---|---|---|---|",
        *(f"| {scan} | {counts.loc[scan, 'learned']} | {counts.loc[scan, 'failed']} | {counts.loc[scan, 'partial']} |"
          for scan in counts.index), "",
        "| run | encoder bottom/top | decoder bottom/top | min LN gain | scan | outcome | agree |", "|---|---|---|---|---|---|---|",
    ]
    for r in table.itertuples():
        lines.append(f"| {r.run} | {r.encoder_bottom_top:.3g} | {r.decoder_bottom_top:.3g} | "
                     f"{r.min_ln_gain:.3g} | {r.scan} | {r.outcome} | "
                     f"{'—' if pd.isna(r.agree) else 'yes' if r.agree else '**no**'} |")
    return "\n".join(lines) + "\n"


def run(args) -> pd.DataFrame | None:
    sweep = Convergence(args.preset, seed=args.seed, device=args.device, batch_size=args.batch_size,
                        init_only=args.init_only)
    specs = sweep.plan()
    with session(args, NAME) as device:
        if args.dry_run:
            print(f"[dry-run] {NAME}: would scan {len(specs)} runs and compare with {args.out / 'convergence_sweep.parquet'}")
            return None
        bench = Bench(task=sweep.preset.task(args.seed), device=device, batch_size=sweep.preset.batch_size,
                      seed=args.seed, progress=False)
        sweep_path = args.out / "convergence_sweep.parquet"
        if args.init_only:
            table = scan_rows(specs, bench)
            text = scan_markdown(table, args.preset, [sweep.preset.describe(), *sweep.setting_notes()])
        elif not sweep_path.exists():
            raise SystemExit(f"{NAME}: {sweep_path} not found; run `python -m analyses.convergence --preset {args.preset} "
                             f"--out {args.out}` first")
        else:
            table = agreement(scan_rows(specs, bench), pd.read_parquet(sweep_path))
            text = markdown(table, args.preset)
        atomic_write(args.out / f"{NAME}.md", lambda tmp: open(tmp, "w", encoding="utf-8").write(text))
        save_plain_table(table, args.out, NAME)
        print(text.split("\n\n")[2])
    return table


main = entry_point(__doc__, run, name=NAME)


if __name__ == "__main__":
    sys.exit(main())
