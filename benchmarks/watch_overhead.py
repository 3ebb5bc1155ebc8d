"""Cost of the spike watch (``Recorder(on_spike="replay")``) on steps that do not spike.

The d=256 reference of :mod:`benchmarks.overhead` (a Pre-LN 6+6 encoder–decoder, batch 32 ×
64 tokens, Adam), three copies of the same weights, each with its own optimizer:

- ``plain``: no recorder ever attached (the reference);
- ``unwatched``: a Recorder with ``every=1000`` whose steps (after step 0) are not recorded,
  stepped with ``with rec.step(i):`` (hooks passing through);
- ``watched``: the same Recorder with ``on_spike="replay"``, stepped with ``rec.run(i, closure)``:
  the RNG states taken, the total gradient norm (one ``get_total_norm``), one host transfer
  of loss and norm, the spike rule on the host.

For each timed round the three steps run back to back, the order rotating between rounds; a
ratio is the median over rounds of the per-round ratio, so slow drifts of a shared machine
cancel. The issue's target: ``watched / unwatched`` ≤ 1.01 (and ``watched / plain``
close to ``unwatched / plain``). A round in which the watch flagged a step (a replay, which
runs the step twice) is reported and left out. The load average is printed before and after.

    python -m benchmarks.watch_overhead                  # eager, 30 rounds
    python -m benchmarks.watch_overhead --rounds 60 --compile
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch

import gradscope
from benchmarks.allocator import steady
from benchmarks.overhead import timed
from benchmarks.overhead_methods import loss_of, make_batch, make_model, make_optimizer, maybe_compile

NAMES = ("plain", "unwatched", "watched")


def build(args: argparse.Namespace):
    """The three copies: name -> (step function, recorder or None)."""
    base = make_model(args.layers, args.d_model, args.device)
    batch = make_batch(args.batch_size, args.length, args.device)
    out = {}
    for name in NAMES:
        model = copy.deepcopy(base)
        opt = make_optimizer(model)
        rec = None
        if name != "plain":
            rec = gradscope.Recorder(model, every=1000, on_spike="replay" if name == "watched" else None)
        run = maybe_compile(model, args.compile)

        def closure(run=run):
            loss = loss_of(run, batch)
            loss.backward()
            return loss

        def step(i, rec=rec, opt=opt, closure=closure, name=name):
            if name == "watched":
                rec.run(i, closure)
            elif name == "unwatched":
                with rec.step(i):
                    closure()
            else:
                closure()
            opt.step()
            opt.zero_grad(set_to_none=True)

        out[name] = (step, rec)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.watch_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (each: one step of every copy); default: %(default)s")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per copy first; default: %(default)s")
    parser.add_argument("--layers", type=int, default=12, help="encoder plus decoder layers; default: %(default)s (6+6)")
    parser.add_argument("--d-model", type=int, default=256, help="model width; default: %(default)s")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per batch; default: %(default)s")
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence; default: %(default)s")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: %(default)s")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads; default: %(default)s")
    parser.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) every copy (the Recorder first)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"allocator: {steady() if args.device == 'cpu' else 'cuda'}; load average before: {os.getloadavg()}")
    copies = build(args)
    for i in range(args.warmup):
        for name in NAMES:
            copies[name][0](i)
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    flagged_rounds = []
    watch = copies["watched"][1].watch
    for r in range(args.rounds):
        i = args.warmup + r
        before = len(watch.flagged)
        order = NAMES[r % 3:] + NAMES[: r % 3]  # rotate who goes first
        got = {name: timed(copies[name][0], i, args.device) for name in order}
        if len(watch.flagged) > before:
            flagged_rounds.append(i)
            continue
        for name in NAMES:
            times[name].append(got[name])
    for _, rec in copies.values():
        if rec is not None:
            rec.close()
    mode = "compiled" if args.compile else "eager"
    print(f"d={args.d_model}, {args.layers // 2}+{args.layers // 2} layers, batch {args.batch_size}x{args.length}, "
          f"{args.device}, {mode}, {args.threads} thread(s), {len(times['plain'])} rounds"
          + (f" ({len(flagged_rounds)} left out: the watch flagged steps {flagged_rounds})" if flagged_rounds else ""))
    print(f"plain step: median {statistics.median(times['plain']) * 1e3:.1f} ms")
    for a, b in (("unwatched", "plain"), ("watched", "plain"), ("watched", "unwatched")):
        ratios = [x / y for x, y in zip(times[a], times[b])]
        added = [(x - y) * 1e3 for x, y in zip(times[a], times[b])]
        q = statistics.quantiles(ratios, n=4)
        print(f"{a:>9} / {b:<9}: {statistics.median(ratios):.4f}x (25th-75th {q[0]:.4f}-{q[2]:.4f}), "
              f"{statistics.median(added):+.2f} ms")
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
