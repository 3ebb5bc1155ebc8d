"""Runs every analysis in sequence: ``python -m analyses --preset default --out figures``.

Each analysis writes its figure (PNG, PDF), its table (parquet) and its section of
``<out>/CLAIMS.md`` and prints its verdicts; at the end the time of each analysis and
the total are printed. The flags are those of every ``python -m analyses.<name>``; with
``--init-only`` the analyses whose claims need training are skipped.
"""

from __future__ import annotations

import importlib
import sys
import time

from tqdm.auto import tqdm

from analyses import ANALYSES, VALIDATIONS
from analyses.cli import parse_args
from analyses.runner import run


def main(argv: list[str] | None = None) -> int:
    args = parse_args("python -m analyses", __doc__, argv)
    times: dict[str, float] = {}
    start = time.perf_counter()
    bar = tqdm(ANALYSES + VALIDATIONS, desc="analyses", unit="analysis", disable=True if args.no_progress else None)
    for name in bar:
        bar.set_postfix_str(name)
        t0 = time.perf_counter()
        module = importlib.import_module(f"analyses.{name}")
        if args.init_only and name in ANALYSES and not module.ANALYSIS.at_init:
            print(f"{name}: skipped (--init-only; its claims need training)", flush=True)
            continue
        run(module.ANALYSIS, args) if name in ANALYSES else module.run(args)
        times[name] = time.perf_counter() - t0
    bar.close()
    total = time.perf_counter() - start
    print("\n".join(f"{name:>16}: {t:7.1f} s" for name, t in times.items()))
    print(f"all analyses: {total:.1f} s ({total / 60:.1f} min) at preset {args.preset}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
