"""Where a recorded step's added host time goes: entering the step, forward, backward, leaving it, the optimizer.

``benchmarks.overhead`` gives the added time of a whole step; this script splits it. Two
copies of the same model train side by side, one plain (no recorder ever attached) and one
recorded with the Recorder's default quantities; each timed pair runs one step of each,
the order alternating between pairs. Every phase of a step is timed with
``time.perf_counter`` (on CUDA after a synchronise, so a phase is its host work plus what
it waits for), and a cell is the median over pairs of the per-pair difference (recorded −
plain), so slow drifts of a shared machine cancel. The phases:

- ``enter``: ``rec.begin_step`` (arming the hooks, resetting the buffers); 0 for the plain copy;
- ``forward``: the loss (the model's forward);
- ``backward``: ``loss.backward()`` and ``rec.log("loss", loss)``;
- ``exit``: ``rec.end_step`` (parameter-gradient norms, the one host transfer); 0 for the plain copy;
- ``optimizer``: ``opt.step()`` and ``opt.zero_grad(set_to_none=True)``.

The per-phase medians need not add up to the median of the totals. Timed steps record
neither ``cosine`` nor ``update_ratio`` (their indices are not multiples of ``slow_every``;
warm-up steps record both), so the table is what most recorded steps cost. The figures in
``benchmarks/RESULTS.md`` come from::

    python -m benchmarks.phases                  # d=16, 6+6 layers, batch 2×5, 200 pairs, eager and compiled
    python -m benchmarks.phases --no-compile --pairs 400
    python -m benchmarks.phases --unrecorded --pairs 400   # steps the attached Recorder does not record

With ``--unrecorded`` the ``enter`` and ``exit`` cells are the Recorder's whole host work on
such a step (the plain copy has none there); the other phases differ between two plain
copies by up to ≈0.5 ms at d=16 (compiled), which is what those cells then show.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from collections.abc import Callable

import torch

import gradscope
from benchmarks.allocator import steady
from benchmarks.overhead import load_line, machine
from benchmarks.overhead_methods import loss_of, make_batch, make_model, make_optimizer, maybe_compile

PHASES = ("enter", "forward", "backward", "exit", "optimizer")
SLOW_EVERY = 10  # the Recorder's slow_every: timed steps are never multiples of it
UNRECORDED_EVERY = 1000  # --unrecorded: the Recorder's every; of the steps run, only step 0 is a multiple of it


def stepper(model: torch.nn.Module, batch, compiled: bool, device: str, rec: gradscope.Recorder | None
            ) -> Callable[[int], tuple[float, ...]]:
    """A function that runs training step ``i`` and returns the seconds of each of ``PHASES``."""
    opt = make_optimizer(model)
    run = maybe_compile(model, compiled)
    if rec is not None:
        rec.attach_optimizer(opt)

    def now() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def step(i: int) -> tuple[float, ...]:
        t0 = now()
        if rec is not None:
            rec.begin_step(i)
        t1 = now()
        loss = loss_of(run, batch)
        t2 = now()
        loss.backward()
        if rec is not None:
            rec.log("loss", loss)
        t3 = now()
        if rec is not None:
            rec.end_step()
        t4 = now()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t5 = now()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4
    return step


def measure(args: argparse.Namespace, compiled: bool) -> str:
    """One table line: the plain step's time and the added µs of each phase, median over pairs."""
    base = make_model(args.layers, args.d_model, args.device)
    batch = make_batch(args.batch_size, args.length, args.device)
    plain_model, recorded_model = copy.deepcopy(base), copy.deepcopy(base)
    # before compiling, as the docs say; --unrecorded: only warm-up step 0 records (every timed step is odd)
    rec = gradscope.Recorder(recorded_model, slow_every=SLOW_EVERY, every=UNRECORDED_EVERY if args.unrecorded else 1)
    plain, recorded = (stepper(plain_model, batch, compiled, args.device, None),
                       stepper(recorded_model, batch, compiled, args.device, rec))
    for i in range(args.warmup):  # step 0 records cosine and update_ratio; the others do not: both graphs compile
        plain(i)
        recorded(i)
    gc.collect()
    pairs: list[tuple[tuple[float, ...], tuple[float, ...]]] = []
    for k in range(args.pairs):
        i = SLOW_EVERY * (args.warmup + k) + 1  # recorded, not a slow step
        if k % 2:
            p = plain(i)
            r = recorded(i)
        else:
            r = recorded(i)
            p = plain(i)
        pairs.append((p, r))
        if args.progress and (k + 1) % max(1, args.pairs // 10) == 0:
            print(f"  {'compiled' if compiled else 'eager'}: {k + 1}/{args.pairs} pairs", file=sys.stderr)
    frame = rec.frame()
    rows = int((frame.step > args.warmup).sum()) if len(frame) else 0  # rows of the timed steps
    rec.close()
    if rows == 0 and not args.unrecorded:
        raise RuntimeError("the recorded copy left no rows: its figures would time nothing")
    if rows and args.unrecorded:
        raise RuntimeError(f"--unrecorded: the timed steps recorded {rows} rows")
    plain_ms = statistics.median(sum(p) for p, _ in pairs) * 1e3
    total = statistics.median(sum(r) - sum(p) for p, r in pairs) * 1e6
    cells = [statistics.median(r[j] - p[j] for p, r in pairs) * 1e6 for j in range(len(PHASES))]
    mode = "compiled" if compiled else "eager"
    return (f"| {mode} | {plain_ms:.2f} | {total:+.0f} | " + " | ".join(f"{c:+.0f}" for c in cells)
            + f" | {rows} |")


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.phases", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12, help="total layers, encoder + decoder (default: 12)")
    parser.add_argument("--d-model", type=int, default=16, help="model width (default: 16, where the host is the whole step)")
    parser.add_argument("--batch-size", type=int, default=2, help="sentences per batch (default: 2)")
    parser.add_argument("--length", type=int, default=5, help="tokens per sentence (default: 5)")
    parser.add_argument("--pairs", type=int, default=200, help="timed (plain, recorded) pairs per mode (default: 200)")
    parser.add_argument("--warmup", type=int, default=30, help="untimed pairs first, at least 2 (default: 30)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also time compiled steps, torch.compile(fullgraph=True) (default: on)")
    parser.add_argument("--unrecorded", action="store_true",
                        help="time steps the attached Recorder does not record (every=1000; only warm-up step 0 records)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="print progress to stderr (default: on)")
    args = parser.parse_args(argv)
    if args.warmup < 2:
        parser.error("--warmup must be at least 2 (a recorded slow step and a plain recorded step before timing)")
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    print(f"allocator: {steady() if args.device == 'cpu' else 'default (CUDA)'}")
    print(machine())
    print(load_line("before"))
    print(f"{args.layers // 2}+{args.layers // 2} pre_ln, d={args.d_model}, batch {args.batch_size}×{args.length}, "
          f"default quantities, {'steps not recorded, ' if args.unrecorded else ''}{args.pairs} interleaved pairs; "
          "added µs per phase, median of per-pair differences")
    print("\n| mode | plain step (ms) | added, whole step (µs) | " + " | ".join(PHASES) + " | rows |")
    print("|---|---:|---:|" + "---:|" * len(PHASES) + "---:|")
    for compiled in (False, True) if args.compile else (False,):
        print(measure(args, compiled), flush=True)
    print("\n" + load_line("after"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
