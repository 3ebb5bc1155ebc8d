"""Runs every analysis: ``python -m analyses --preset default --out figures``.

The runs of every analysis go to one pool of ``--workers`` processes, longest first, and a
training that several analyses plan runs once (:mod:`analyses.pool`). Each analysis writes
its figure (PNG, PDF), its table (parquet) and its section of ``<out>/CLAIMS.md`` and prints
its verdicts as soon as its last run is in; at the end the compute of each analysis and the
total wall time are printed. The flags are those of every ``python -m analyses.<name>``; with
``--init-only`` the analyses whose claims need training are skipped.
"""

from __future__ import annotations

import importlib
import sys
import time

from analyses import ANALYSES, VALIDATIONS
from analyses.cli import parse_args
from analyses.pool import run_all
from analyses.runner import run


def main(argv: list[str] | None = None) -> int:
    args = parse_args("python -m analyses", __doc__, argv)
    start = time.perf_counter()
    analyses = []
    for name in ANALYSES:
        kind = importlib.import_module(f"analyses.{name}").ANALYSIS
        if args.init_only and not kind.at_init:
            print(f"{name}: skipped (--init-only; its claims need training)", flush=True)
            continue
        analyses.append(kind)
    if args.dry_run or args.redraw:  # (nothing to train: one after another)
        for kind in analyses:
            run(kind, args)
        seconds: dict[str, float] = {}
    else:
        seconds = run_all([kind(args.preset, seed=args.seed, device=args.device, max_steps=args.max_steps,
                                batch_size=args.batch_size, init_only=args.init_only) for kind in analyses], args)
    for name in VALIDATIONS:
        t0 = time.perf_counter()
        importlib.import_module(f"analyses.{name}").run(args)
        seconds[name] = time.perf_counter() - t0
    total = time.perf_counter() - start
    print("compute per analysis (its runs' seconds summed over the workers; a run two analyses share "
          "counts for the one that records it):")
    print("\n".join(f"{name:>16}: {t:7.1f} s" for name, t in seconds.items()))
    print(f"all analyses: {total:.1f} s ({total / 60:.1f} min) wall at preset {args.preset}, "
          f"{args.workers} worker(s)", flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())
