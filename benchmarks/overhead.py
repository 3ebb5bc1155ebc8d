"""Recorder overhead: step-time ratios to a plain training step, eager and compiled, side by side.

Every method gets its own copy of the same model and optimizer; one plain copy per depth and
mode, which never has a recorder attached, is the reference. For each timed pair one plain
step and one step of the method run back to back, the order alternating between pairs; a
cell is the median over pairs of the per-pair ratio (method / plain), so slow drifts of a
shared machine cancel. The load average is printed before and after: run it on a quiet
machine and say so. On the CPU the allocator is held steady by default (``--allocator``,
:mod:`benchmarks.allocator`): glibc's page faults, which follow the allocation order rather
than the work, otherwise move a 205 ms step by ±5 ms on either side.

    python -m benchmarks.overhead                          # 6+6, 12+12, 24+24 layers, d=256, eager and compiled
    python -m benchmarks.overhead --depths 12 --pairs 10   # the 6+6 reference only
    python -m benchmarks.overhead --depths 12 --pairs 30 --device cuda
    python -m benchmarks.overhead --depths 12 --no-compile --breakdown --only gradscope   # cost per quantity
    python -m benchmarks.overhead --depths 12 --sets outliers weights --only default outliers weights   # opt-in sets
    python -m benchmarks.overhead --depths 12 --d-model 16 --batch-size 2 --length 5 --pairs 200   # host cost

Compiled column: each model copy is compiled once with ``torch.compile(fullgraph=True)``
(the Recorder made first) and warmed up on recorded and unrecorded steps (step 0 records
cosine, step 1 does not; the ``every=1000`` recorder records step 0 only), so no compile
happens while timing: the script counts Dynamo graphs and Inductor compiles around the timed
steps and rejects a cell that compiled there. A recording method's cell counts only if its
timed steps left rows in the table; the checks table after the results says how many.

Several copies of one model class compile in one process, with Dynamo's default settings:
a Recorder's armed modules have classes of their own (``gradscope/recorder/capture/hookset.py``),
so no copy runs a graph traced from another.

Methods (``benchmarks.overhead_methods``): a second plain copy (an A/A control: how far two
identical steps differ here), gradscope with default quantities (norms), gradscope with all
quantities (cosine and update ratio every 10 steps: ``every=1``, ``slow_every=10``, so one
timed step in ten records them), the signals before instability (``quantities="signals"``:
default plus attention logits and entropy, output log Z, sub-layer RMS and gradient RMS over ε)
recorded every step and every 10th step, a Recorder attached whose steps are not recorded
(``every=1000``: the cost of hooks passing through), bare hooks taking one squared norm per
distinct site value and gradient with no bookkeeping, alone and with every parameter gradient's
(the floor named in issue 25: the reductions the default quantities need, a bounded one per
tensor, and nothing else; eager only), two simple references that do what a recorder of these
quantities has to do, with gradscope's own fp64 reduction and no books (*simple site hooks*: a
forward pre-hook per site, registered once, that keeps the gradient of the tensor each site
receives by ``retain_grad``, then the squared norms of the values, their gradients and the
parameters' gradients and one transfer; eager only; with *each site's own gradient* every site
passes on an alias, as gradscope does; *simple parameter norms*: ``p.grad`` of a list taken
once, their squared norms, one transfer, eager and compiled), a naive loop calling
``p.grad.norm().item()`` per parameter, gradscope's default quantities logged live to an
offline W&B run (``WandbSink``) next to ``wandb.watch(model, log="gradients", log_freq=1)``
offline, and Lightning's ``grad_norm`` (the last three only when installed: ``pip install -e
".[bench]"``). Under compile the peers' model is compiled and their norm loops stay eager, as
in a user's loop.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters

from benchmarks.allocator import steady
from benchmarks.overhead_methods import (
    METHODS,
    EagerOnly,
    Method,
    breakdown_methods,
    make_batch,
    make_model,
    make_optimizer,
    plain,
    set_methods,
)
from gradscope.recorder.quantities.registry import QUANTITY_SETS, resolve_quantities

PLAIN = "plain step (ms; the reference)"


def timed(step: Callable[[int], None], i: int, device: str) -> float:
    """Seconds taken by ``step(i)``, synchronising the GPU before and after on CUDA."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(i)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def compiles_so_far() -> int:
    """Dynamo graphs plus AOTAutograd and Inductor compiles (cache hits included) so far."""
    inductor = counters["inductor"]
    return (counters["stats"]["unique_graphs"] + counters["aot_autograd"]["total"]
            + inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_hit"])


def spread(ratios: list[float], added: list[float]) -> str:
    """``median× (25th–75th percentile), +median added ms`` of per-pair ratios and of the
    per-pair added time (method − plain): the added milliseconds are the host cost a GPU
    user pays when the model is so narrow that the arithmetic is nothing (``--d-model 16``)."""
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    return (f"{statistics.median(ratios):.3f}× ({q[0]:.3f}–{q[2]:.3f}), {1e3 * statistics.median(added):+.2f} ms"
            f" (mean {1e3 * statistics.fmean(added):+.2f})")


def measure_method(method: Method, base: torch.nn.Module, batch, ref: Callable[[int], None], ref_times: list[float],
                   compiled: bool, args) -> tuple[str, dict]:
    """Times one method against the plain reference.

    Args:
        method: the method.
        base: the model every copy is taken from.
        batch: the fixed batch.
        ref: the plain reference's step (already warmed up).
        ref_times: list the plain step's timings are appended to.
        compiled: whether the method's model copy is compiled.
        args: the parsed command line.

    Returns:
        The table cell, and the checks of this cell (warm-up seconds, compiles during
        warm-up and during timing, rows recorded by the timed steps).
    """
    model = copy.deepcopy(base)
    opt = make_optimizer(model)
    try:
        runner = method.setup(model, opt, batch, compiled)
    except ImportError as err:
        return f"not installed ({err.name})", {}
    except EagerOnly as err:
        return str(err), {}
    twin = None
    if args.twin:  # a plain copy made beside the method's (the same moment in the process), never recorded
        twin_model = copy.deepcopy(base)
        twin = plain(twin_model, make_optimizer(twin_model), batch, compiled).step
    check: dict = {}
    try:
        c0, t0 = compiles_so_far(), time.perf_counter()
        for i in range(args.warmup):
            runner.step(i)
            if twin is not None:
                twin(i)
        check["warm-up s"] = f"{time.perf_counter() - t0:.1f}"
        c1 = compiles_so_far()
        check["compiles in warm-up"] = c1 - c0
        ratios, added, over_twin = [], [], []
        steps = [ref, runner.step] + ([twin] if twin is not None else [])
        for r in range(args.pairs):
            i = args.warmup + r
            times = [0.0] * len(steps)
            for j in range(r, r + len(steps)):  # each kind runs first, second (and third) in turn
                times[j % len(steps)] = timed(steps[j % len(steps)], i, args.device)
            t_ref, t = times[0], times[1]
            ratios.append(t / t_ref)
            added.append(t - t_ref)
            ref_times.append(t_ref)
            if twin is not None:
                over_twin.append(t - times[2])
        check["compiles in timing"] = compiles_so_far() - c1
        check["graph breaks"] = sum(counters["graph_break"].values())
        df = runner.frame()
        if df is not None:
            check["rows in timed steps"] = int((df.step >= args.warmup).sum())
            check["rows in warm-up"] = int((df.step < args.warmup).sum())
    except Exception as err:  # noqa: BLE001 -- report what broke, with its trace, and go on with the others
        print(f"\n[{method.name}, {'compiled' if compiled else 'eager'}] failed:", file=sys.stderr)
        traceback.print_exc()
        return f"error: {type(err).__name__} (trace on stderr)", check
    finally:
        runner.finish()
    cell = spread(ratios, added)
    if over_twin:
        cell += f"; {1e3 * statistics.median(over_twin):+.2f} ms over its plain twin"
    if check["compiles in timing"]:
        cell = f"INVALID, compiled while timing: {cell}"
    if method.records and not check.get("rows in timed steps"):
        cell = f"INVALID, no rows recorded: {cell}"
    return cell, check


def measure(total_layers: int, args, compiled: bool, methods: list[Method]) -> tuple[dict[str, str], dict[str, dict]]:
    """Every method at one depth, eager or compiled.

    Returns:
        Method name -> table cell, and method name -> its checks.
    """
    base = make_model(total_layers, args.d_model, args.device)
    batch = make_batch(args.batch_size, args.length, args.device)
    ref_model = copy.deepcopy(base)
    ref = plain(ref_model, make_optimizer(ref_model), batch, compiled).step
    c0, t0 = compiles_so_far(), time.perf_counter()
    for i in range(args.warmup):
        ref(i)
    checks = {PLAIN: {"warm-up s": f"{time.perf_counter() - t0:.1f}", "compiles in warm-up": compiles_so_far() - c0}}
    cells, ref_times = {}, []
    for method in methods:
        cells[method.name], checks[method.name] = measure_method(method, base, batch, ref, ref_times, compiled, args)
        gc.collect()
    cells = {PLAIN: f"{1e3 * statistics.median(ref_times):.1f} ms" if ref_times else "-", **cells}
    if compiled:
        torch._dynamo.reset()  # the next depth compiles afresh
    return cells, checks


def machine() -> str:
    """One line describing where this runs."""
    cpu = f"{platform.machine()} CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    dev = f"{torch.cuda.get_device_name()}; " if torch.cuda.is_available() else ""
    return f"{dev}{cpu}; Python {platform.python_version()}; torch {torch.__version__}"


def load_line(when: str) -> str:
    """The 1/5/15-minute load average, with a warning when something else seems to be running."""
    one, five, fifteen = os.getloadavg()
    warn = ""
    if when == "before" and one > 0.5:
        warn = f"  WARNING: load {one:.2f} before the run: something else is running, ratios are noisier"
    return f"load average {when}: {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} cores){warn}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[12, 24, 48],
                        help="total layers (encoder + decoder), split evenly: 12 is the 6+6 reference (default: 12 24 48)")
    parser.add_argument("--d-model", type=int, default=256, help="model width (default: 256)")
    parser.add_argument("--batch-size", type=int, default=16, help="sentences per batch (default: 16)")
    parser.add_argument("--length", type=int, default=32, help="tokens per sentence (default: 32)")
    parser.add_argument("--pairs", "--repeats", dest="pairs", type=int, default=20,
                        help="timed (plain, method) pairs per method and mode (default: 20)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first, at least 2: step 0 records cosine, step 1 does not (default: 3)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to run (default: cuda if available)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also time compiled steps, torch.compile(fullgraph=True) (default: on; --no-compile: eager only)")
    parser.add_argument("--only", nargs="*", default=None, help="substrings of method names to run (default: all)")
    parser.add_argument("--sets", nargs="*", default=[],
                        help="also time gradscope with each of these quantity presets (e.g. outliers weights), or "
                             "comma-separated lists of quantity names (act_abs_max,act_kurtosis)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time gradscope with one quantity at a time (where the cost is)")
    parser.add_argument("--twin", action="store_true",
                        help="also time, in the same rotation, a plain copy made beside each method's copy, and give the "
                             "method's added time over it: a compiled copy's step time depends on when it was made by "
                             "±0.2-0.7 ms at d=16, which the reference's own copy carries")
    parser.add_argument("--recompile-limit", type=int, default=64,
                        help="torch._dynamo recompile (cache size) limit: every copy's graphs share one code object (default: 64)")
    parser.add_argument("--allocator", choices=["steady", "default"], default="steady",
                        help="steady: glibc keeps freed memory, so page faults that follow the allocation order, not the "
                             "work, drop out of both sides (benchmarks/allocator.py); default: as the process starts "
                             "(default: steady)")
    args = parser.parse_args(argv)
    for name in args.sets:
        try:
            resolve_quantities(name if name in QUANTITY_SETS else name.split(","))
        except ValueError as e:
            parser.error(f"--sets {name}: {e}")
    if args.warmup < 2:
        parser.error("--warmup must be at least 2 (a recorded and an unrecorded step before timing)")
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints the results table, then the checks table."""
    args = parse(argv)
    torch._dynamo.config.cache_size_limit = args.recompile_limit
    torch._dynamo.config.accumulated_cache_size_limit = max(256, 8 * args.recompile_limit)
    methods = METHODS + set_methods(args.sets) + (breakdown_methods() if args.breakdown else [])
    if args.only:
        methods = [m for m in methods if any(o in m.name for o in args.only)]
    modes = [False, True] if args.compile else [False]
    mode_name = {False: "eager", True: "compiled"}
    allocator = steady() if args.allocator == "steady" else "default (as the process started)"
    print(f"machine: {machine()}")
    print(f"allocator: {allocator}")
    print(load_line("before"))
    print(f"command: python -m benchmarks.overhead {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"model: pre_ln encoder-decoder, d={args.d_model}, batch {args.batch_size}x{args.length} tokens, Adam; "
          f"{args.pairs} pairs after {args.warmup} warm-up steps per method and mode", flush=True)
    columns = [(d, c) for d in args.depths for c in modes]
    table: dict[str, list[str]] = {}
    checks: list[tuple[str, str, dict]] = []
    t_start = time.perf_counter()
    for depth, compiled in columns:
        cells, cell_checks = measure(depth, args, compiled, methods)
        for name, cell in cells.items():
            table.setdefault(name, []).append(cell)
        label = f"{depth} layers {mode_name[compiled]}"
        checks += [(name, label, c) for name, c in cell_checks.items() if c]
        print(f"  measured {label} ({time.perf_counter() - t_start:.0f} s so far): "
              + "; ".join(f"{name}: {cell}" for name, cell in cells.items()), file=sys.stderr, flush=True)
    print(load_line("after"))
    print(f"total time: {time.perf_counter() - t_start:.0f} s\n")
    print("| method | " + " | ".join(f"{d} layers {mode_name[c]}" for d, c in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, cells in table.items():
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nCells: median of per-pair step-time ratios to a plain step of the same mode (interquartile range),\n"
          "then the median of the per-pair added time (method − plain, ms) and its mean, which also holds the\n"
          "rare steps that build the waiting rows (every 64 recorded steps); the plain row is its median step\n"
          "time. A compiled ratio compares compiled with compiled. At --d-model 16 the arithmetic is nothing\n"
          "and the added time is the host work a GPU user pays (no GPU is lent to this project).\n")
    keys = ["warm-up s", "compiles in warm-up", "compiles in timing", "graph breaks", "rows in warm-up", "rows in timed steps"]
    print("| method | column | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for name, label, c in checks:
        print(f"| {name} | {label} | " + " | ".join(str(c.get(k, "-")) for k in keys) + " |")
    print("\nChecks: compiles counts Dynamo graphs + AOTAutograd + Inductor compiles (cache hits included);\n"
          "graph breaks is the process total so far; rows are the recorded table's rows by step.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
