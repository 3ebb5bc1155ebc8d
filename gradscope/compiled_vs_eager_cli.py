"""``python -m gradscope compile-audit --model pkg.module:factory``: the compile audit on a synthetic batch.

``factory()`` returns the model (an ``nn.Module`` taking token ids (B, T)). The batch is
random token ids; the loss is next-token cross entropy when the output's last dimension is the
vocabulary (HF outputs: ``.logits``), else the mean square of the output. Prints the table of
the values past the tolerance (or the largest differences), the verdict, and writes
``compile_audit.png`` and ``compile_audit.parquet``. Exit status 1 when a value diverges.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from gradscope.compiled_vs_eager import DEFAULT_TOLERANCE, compile_audit
from gradscope.model_spec import ModelSpecError, load_model
from gradscope.recorder.capture.signals import vocab_sizes


def add_parser(sub) -> argparse.ArgumentParser:
    """Adds the ``compile-audit`` command to ``python -m gradscope``'s sub-parsers."""
    p = sub.add_parser("compile-audit", help="one synthetic batch eager and compiled: the first site that differs",
                       description="Builds the model from FACTORY, runs one synthetic batch eagerly and under "
                       "torch.compile on the same weights and RNG state, and compares activation norms, activation-"
                       "gradient norms and parameter-group gradient norms site by site. Exit status 1 on a divergence.")
    p.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                   help="'package.module:factory', factory() returning an nn.Module that takes token ids (B, T)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences in the synthetic batch (default: 2)")
    p.add_argument("--length", type=int, default=16, help="tokens per sequence (default: 16)")
    p.add_argument("--vocab", type=int, default=None,
                   help="token ids drawn below this (default: the model's config.vocab_size or embedding size)")
    p.add_argument("--tolerance", type=float, default=None,
                   help=f"relative difference past which a value diverges (default: {DEFAULT_TOLERANCE[torch.float32]:g} "
                   "for fp32/fp64 weights, 5e-2 for bf16/fp16)")
    p.add_argument("--eval", action="store_true", help="audit in eval mode (default: the mode the factory returns)")
    p.add_argument("--seed", type=int, default=0, help="seed for the factory's weights and the batch (default: 0)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--out", type=Path, default=Path("compile_audit"),
                   help="folder for compile_audit.png and compile_audit.parquet (default: ./compile_audit)")
    return p


def synthetic_loss(ids: torch.Tensor, vocab: int) -> Callable:
    """Next-token cross entropy against ``ids`` (B, T) when the output (or its ``.logits``, or
    its first item) is (B, T, vocab), else the mean square of the output."""

    def loss_fn(out) -> torch.Tensor:
        t = getattr(out, "logits", out)
        t = t[0] if isinstance(t, (tuple, list)) else t
        if t.dim() == 3 and t.shape[-1] == vocab:
            return F.cross_entropy(t[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        return t.float().square().mean()

    return loss_fn


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs the ``compile-audit`` command."""
    for name in ("batch_size", "length"):
        if getattr(args, name) < 2:
            parser.error(f"--{name.replace('_', '-')} must be >= 2")
    if args.tolerance is not None and not args.tolerance > 0:
        parser.error(f"--tolerance must be > 0, got {args.tolerance}")
    torch.manual_seed(args.seed)
    try:
        model = load_model(args.model)
    except ModelSpecError as err:
        parser.error(str(err))
    model = model.to(args.device)
    if args.eval:
        model.eval()
    vocab = args.vocab or max(vocab_sizes(model), default=0)
    if vocab < 2:
        parser.error("--vocab: the model has no config.vocab_size and no embedding table; give --vocab (>= 2)")
    ids = torch.randint(0, vocab, (args.batch_size, args.length), generator=torch.Generator().manual_seed(args.seed))
    ids = ids.to(args.device)
    result = compile_audit(model, ids, synthetic_loss(ids, vocab), tolerance=args.tolerance)
    shown = result.table[result.table.past] if not result.passed else result.table.nlargest(10, "rel_diff")
    print(shown.head(20).to_string(index=False, float_format=lambda v: f"{v:.6g}"))
    print()
    print(result.summary())
    _save(result, args.out, args.model)
    return 0 if result.passed else 1


def _save(result, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradscope.io import atomic_write

    out.mkdir(parents=True, exist_ok=True)  # (the audit's table, not a recorder table: pandas' own parquet)
    atomic_write(out / "compile_audit.parquet", lambda tmp: result.table.to_parquet(tmp, index=False))
    fig, ax = plt.subplots(figsize=(8, 4))
    result.figure(ax=ax, title=f"gradscope compile-audit: {title}")
    fig.tight_layout()
    atomic_write(out / "compile_audit.png", lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    plt.close(fig)
    print(f"\nwrote {out / 'compile_audit.png'} and {out / 'compile_audit.parquet'}", file=sys.stdout)
