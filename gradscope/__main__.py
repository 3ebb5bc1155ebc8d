"""``python -m gradscope scan ...`` / ``report ...`` / ``compile-audit ...``: see ``python -m gradscope <command> --help``."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path


def scan_parser(sub) -> argparse.ArgumentParser:
    from gradscope import presets
    from gradscope.models import INITS, VARIANTS
    from gradscope.models.variants import ARCHS
    from gradscope.scan import HF_ARCHS

    size = presets.small()  # the zoo model's size unless the flags say otherwise

    p = sub.add_parser("scan", help="one forward/backward on a synthetic batch: per-layer gradient table, figure, verdict",
                       description="One forward/backward on a synthetic batch of a zoo model or a HuggingFace architecture "
                       "(built from its config class, random weights, no download). Prints a per-layer table and a verdict "
                       "(gradient decay bottom/top, smallest LayerNorm gain, non-finite sites) and saves a figure and the table.")
    p.add_argument("--variant", default="post_ln", choices=sorted(VARIANTS), help="zoo wiring (default: post_ln)")
    p.add_argument("--arch", default="encoder_decoder", choices=ARCHS, help="zoo model shape (default: encoder_decoder)")
    p.add_argument("--init", default="xavier", choices=sorted(INITS), help="zoo weight init (default: xavier)")
    p.add_argument("--n-enc", type=int, default=size.n_enc, help="zoo encoder layers (default: %(default)s)")
    p.add_argument("--n-dec", type=int, default=size.n_dec, help="zoo decoder layers (default: %(default)s)")
    p.add_argument("--hf", choices=HF_ARCHS, default=None, help="scan a HuggingFace architecture instead of a zoo model")
    p.add_argument("--model", default=None, metavar="PKG.MODULE:FACTORY",
                   help="scan your own model: import PKG.MODULE (or a file path/to/file.py) and call FACTORY() for an "
                   "nn.Module; it gets --input tokens (ids of shape (batch, length) in [1, vocab)) or float (default: none, "
                   "a zoo model)")
    p.add_argument("--input", choices=("tokens", "float"), default="tokens",
                   help="--model: its synthetic input, token ids or N(0,1) values of shape (batch, length, d-model) "
                   "(default: tokens)")
    p.add_argument("--n-layer", type=int, default=12, help="--hf: number of layers (default: 12)")
    p.add_argument("--d-model", type=int, default=size.d_model, help="width (default: %(default)s)")
    p.add_argument("--n-heads", type=int, default=size.n_heads, help="attention heads (default: %(default)s)")
    p.add_argument("--d-ff", type=int, default=size.d_ff, help="zoo feed-forward width (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=size.vocab, help="vocabulary size (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="sentences in the synthetic batch (default: 8)")
    p.add_argument("--length", type=int, default=32, help="tokens per sentence (default: 32)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and batch (default: 0)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--out", type=Path, default=Path("scan"), help="folder for scan.png and scan.parquet (default: ./scan)")
    return p


ZOO_ONLY = ("variant", "arch", "init", "n_enc", "n_dec", "d_ff")  # scan flags of a zoo model only
HF_ONLY = ("n_layer",)  # scan flags of --hf only
MODEL_ONLY = ("input",)  # scan flags of --model only


def _check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """Refuses a device string torch does not parse, or a CUDA device this torch cannot use."""
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError as err:
        parser.error(f"--device {device!r}: {err}")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device!r}: this torch has no CUDA device (built with CUDA: "
                     f"{torch.backends.cuda.is_built()}); use --device cpu")


def print_scan(result, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradscope.io import atomic_write, save_frame
    from gradscope.plots import scan_layers

    print(result.layers.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print()
    for line in result.verdicts():
        print(line)
    out.mkdir(parents=True, exist_ok=True)
    save_frame(result.table, out / "scan.parquet")
    fig, ax = plt.subplots(figsize=(6, 4))
    scan_layers(result.layers, ax=ax, title=title)
    fig.tight_layout()
    atomic_write(out / "scan.png", lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    plt.close(fig)
    print(f"\nwrote {out / 'scan.png'} and {out / 'scan.parquet'}")


def kind_of(args) -> str:
    """'with --model' / 'with --hf': which kind of scan the flags asked for."""
    return "with --model" if args.model else "with --hf"


def _show_as_cli(command: str):
    """A ``warnings.showwarning`` for the command line: gradscope's own warnings as one line
    naming the command (their location would be the interpreter's ``runpy``, no line of the
    user's), any other warning as Python shows it."""
    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        text = str(message)
        if not text.startswith("gradscope: "):
            default(message, category, filename, lineno, file, line)
            return
        print(f"gradscope {command}: warning: {text.removeprefix('gradscope: ')}", file=sys.stderr if file is None else file)
    return show


def main(argv: list[str] | None = None) -> int:
    with warnings.catch_warnings():  # (the command's own warning display, put back on return)
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradscope", description="gradscope command line")
    sub = parser.add_subparsers(dest="command", required=True)
    scan_parser(sub)
    from gradscope import report  # -- issue 12: python -m gradscope report RUN_DIR --out DIR --

    report.add_parser(sub)
    from gradscope import compiled_vs_eager_cli  # -- issue 52: python -m gradscope compile-audit --model pkg.mod:factory --

    compiled_vs_eager_cli.add_parser(sub)
    args = parser.parse_args(argv)
    warnings.showwarning = _show_as_cli(args.command)
    if args.command == "report":
        return report.run(args)
    if args.command == "compile-audit":
        _check_device(sub.choices["compile-audit"], args.device)
        return compiled_vs_eager_cli.run(args, sub.choices["compile-audit"])
    scan = sub.choices["scan"]  # (errors below print the scan command's usage)
    for name in ("n_enc", "n_dec", "n_layer", "d_model", "n_heads", "batch_size", "length"):
        if getattr(args, name) < 1:
            scan.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.d_model % args.n_heads and not args.model:
        scan.error(f"--d-model {args.d_model} must be a multiple of --n-heads {args.n_heads}")
    if args.hf and args.model:
        scan.error("--hf and --model: scan one model at a time")
    least = 2 if args.hf or args.model else 4  # (the synthetic batch draws token ids from 1, or from 3 past the zoo's specials)
    if args.vocab < least:
        scan.error(f"--vocab must be >= {least} {kind_of(args) if least == 2 else 'for a zoo model'}, got {args.vocab}")
    _check_device(scan, args.device)
    kind = "--model" if args.model else "--hf" if args.hf else None
    unused = {"--model": ZOO_ONLY + HF_ONLY + ("n_heads",), "--hf": ZOO_ONLY + MODEL_ONLY, None: HF_ONLY + MODEL_ONLY}[kind]
    ignored = [f"--{n.replace('_', '-')}" for n in unused if getattr(args, n) != scan.get_default(n)]
    if ignored:
        print(f"gradscope scan: warning: {', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} ignored "
              f"{f'with {kind}' if kind else 'for a zoo model'}", file=sys.stderr)
    from gradscope.scan import run_scan, scan_own

    try:
        if args.model:
            result, loss_text = scan_own(args)
            print(f"gradscope scan: {args.model}, loss: {loss_text}")
        else:
            result = run_scan(args)
    except ValueError as err:
        scan.error(str(err))
    title = (f"{args.model}" if args.model else f"HF {args.hf}, {args.n_layer} layers" if args.hf
             else f"{args.variant} ({args.init}), {args.n_enc}L-{args.n_dec}L {args.arch}")
    print_scan(result, args.out, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
