"""The command line every ``python -m analyses.<name>`` shares (STYLE §7)."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from gradscope.presets import PRESETS


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The flags every analysis takes (``python -m analyses.<name> --help``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=tuple(PRESETS), default="default",
                        help="model size and training length: ci (minutes on 2 CPU cores), default (a laptop), "
                             "paper (the papers' sizes, for a GPU); see gradscope.presets; default: %(default)s")
    parser.add_argument("--out", type=Path, default=Path("figures"),
                        help="directory for the figure (PNG, PDF), table (parquet) and CLAIMS.md; "
                             "default: %(default)s")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to run: cuda when available with auto; default: %(default)s")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of model init, data and dropout; default: %(default)s")
    parser.add_argument("--threads", type=_positive_int, default=1,
                        help="torch CPU threads; 1 is fastest for these small models on a shared 2-core "
                             "machine; default: %(default)s")
    parser.add_argument("--workers", type=_positive_int, default=1,
                        help="worker processes running an analysis's runs side by side, each with --threads "
                             "threads (make figures uses 2 on a 2-core machine); the tables equal a serial "
                             "run's; default: %(default)s")
    parser.add_argument("--max-steps", type=_positive_int, default=None,
                        help="cap every training run at this many steps (smoke tests); the figures say so")
    parser.add_argument("--batch-size", type=_positive_int, default=None,
                        help="sequences per batch instead of the preset's (e.g. the paper preset's at-init "
                             "analyses on a small CPU); the figure footer and CLAIMS.md detail say so")
    parser.add_argument("--init-only", action="store_true",
                        help="analyses that train (residual_shrink, scan_agreement): record only at "
                             "initialisation and skip training; the figure and CLAIMS.md say so")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the planned runs and build each model once, then exit without training "
                             "or writing anything")
    parser.add_argument("--redraw", action="store_true",
                        help="draw the figure and write CLAIMS.md again from the table an earlier run saved in "
                             "--out (same --preset and flags), without training")
    parser.add_argument("--no-progress", action="store_true", help="hide the per-run tqdm bars")
    return parser


def parse_args(prog: str, description: str, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses ``argv`` with :func:`make_parser`; ``--device cuda`` without CUDA is a usage error."""
    parser = make_parser(prog, description)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    problem = _unwritable(args.out)
    if problem:
        parser.error(f"--out {args.out}: {problem}")
    return args


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _unwritable(out: Path) -> str | None:
    """Why the folder ``out`` could not be written, or None: its nearest existing folder is
    tried with a folder made and removed at once (permissions alone do not tell, for root or
    on /proc), so nothing is left behind."""
    path = out.resolve()
    while not path.exists():
        path = path.parent
    if not path.is_dir():
        return f"{path} is not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gradscope-probe-", dir=path))
    except OSError as err:
        return f"cannot write in {path} ({err.strerror or err})"
    return None
