"""What an open Recorder costs a compiled model it does not record (nothing, now).

gradscope once set ``torch._dynamo.config.skip_nnmodule_hook_guards`` to False while any
Recorder was open, so that two instances of one model class never shared a graph with and
without hooks. Every graph compiled in the process was then guarded on every module's hook
dicts: +1.18 ms a step for a plain compiled d=16 model (1.107×, ``benchmarks/RESULTS.md``).
An armed module now has a class of its own instead (``gradscope/recorder/capture/hookset.py``) and
Dynamo's settings stay as they are; this script checks that an open Recorder costs another
compiled model nothing.

The two cases are measured in separate processes (a Dynamo setting acts when a graph is
compiled, and a process that compiled once keeps its graphs): each run is a fresh
interpreter that compiles the d=16 benchmark model (:mod:`benchmarks.overhead`) and times
``--steps`` training steps, with no Recorder anywhere (``default``) or with a Recorder open
on *another* model (``recorder open``). Runs alternate, ``--runs`` of each; the figure is the
median over pairs of runs of the ratio of their median step times (sequential runs: noisier
than the interleaved pairs of ``benchmarks.overhead``).

    python -m benchmarks.guard_cost               # 3 runs each, 300 steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one_run(recorder_open: bool, steps: int, d_model: int) -> float:
    """Median step time (ms) of a compiled plain model in this process."""
    import torch

    import gradscope
    from benchmarks.overhead_methods import loss_of, make_batch, make_model, make_optimizer

    torch.set_num_threads(1)
    other = gradscope.Recorder(make_model(12, d_model, "cpu")) if recorder_open else None
    model = make_model(12, d_model, "cpu")
    opt, batch = make_optimizer(model), make_batch(2, 5, "cpu")
    run = torch.compile(model, fullgraph=True)
    times = []
    for i in range(steps + 5):
        t = time.perf_counter()
        loss_of(run, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 5:
            times.append(time.perf_counter() - t)
    if other is not None:
        other.close()
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of each case (alternating)")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per run")
    parser.add_argument("--d-model", type=int, default=16)
    parser.add_argument("--child", choices=("default", "open"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_run(args.child == "open", args.steps, args.d_model)))
        return
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result: dict[str, list[float]] = {"default": [], "open": []}
    for r in range(args.runs):
        for case in (("default", "open") if r % 2 == 0 else ("open", "default")):
            out = subprocess.run([sys.executable, "-m", "benchmarks.guard_cost", "--child", case, "--steps",
                                  str(args.steps), "--d-model", str(args.d_model)],
                                 env=env, capture_output=True, text=True, check=True)
            result[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  run {r}: {case:7s} {result[case][-1]:.2f} ms/step", flush=True)
    ratios = [o / d for o, d in zip(result["open"], result["default"])]
    added = [o - d for o, d in zip(result["open"], result["default"])]
    print(f"compiled plain step, d={args.d_model}: {statistics.median(result['default']):.2f} ms with no Recorder, "
          f"{statistics.median(result['open']):.2f} ms with a Recorder open on another model: "
          f"{statistics.median(ratios):.3f}x, {statistics.median(added):+.2f} ms per step "
          f"(median of {args.runs} pairs of runs)")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
