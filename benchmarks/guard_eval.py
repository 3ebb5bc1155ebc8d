"""What Dynamo's guard evaluation costs one compiled forward, recorded and plain.

Every call of a compiled model first checks the graph's guards. A recorded graph has more
of them: the recorder's state, and whatever Dynamo guards on the hooked modules
(``gradscope/recorder/capture/carrying.py`` says why a module whose hooks its class carries adds
none). Timing ``guard_manager.check`` alone, outside a training loop, understates the cost
several times (the guards' objects are then in the cache), so this script times compiled
forwards in one process with the guards evaluated and skipped
(``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``, safe here: one graph per case)
in turn, in blocks of ``--calls``, and reports the median over pairs of blocks of the
difference. A recorded forward is framed by ``begin_step`` and ``abort_step``, as in a
training loop, in both blocks of a pair. Each case runs in a fresh interpreter (a process
that compiled another model first measured the recorded guards ≈ 2× dearer), plain and
recorded in turn, ``--runs`` of each.

    python -m benchmarks.guard_eval             # the d=16 model, 2 runs of 20 pairs of 100 forwards
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time


def guard_cost(recorded: bool, pairs: int, calls: int, d_model: int) -> tuple[float, float, int]:
    """(ms per forward with guards, ms of guard evaluation, guard managers) in this process."""
    import torch
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    import gradscope
    from benchmarks.overhead_methods import loss_of, make_batch, make_model

    torch.set_num_threads(1)
    torch._dynamo.reset()
    model, batch = make_model(12, d_model, "cpu"), make_batch(2, 5, "cpu")
    rec = gradscope.Recorder(model, every=1) if recorded else None
    compiled = torch.compile(model, fullgraph=True)
    step = iter(range(1 << 40))

    def forward() -> None:
        if rec is not None:
            rec.begin_step(next(step))
        loss_of(compiled, batch)
        if rec is not None:
            rec.abort_step()

    for _ in range(5):
        with rec.step(next(step)) if rec is not None else contextlib.nullcontext():
            loss_of(compiled, batch).backward()
    entries = _debug_get_cache_entry_list(type(model).forward.__code__)
    managers = max(str(e.guard_manager).count("GuardManager") for e in entries)
    timed: dict[bool, list[float]] = {False: [], True: []}
    for k in range(pairs):
        for skip in (False, True) if k % 2 else (True, False):
            with torch.compiler.set_stance(skip_guard_eval_unsafe=skip):
                t = time.perf_counter()
                for _ in range(calls):
                    forward()
                timed[skip].append((time.perf_counter() - t) / calls * 1e3)
    if rec is not None:
        rec.close()
    guards = statistics.median(g - s for g, s in zip(timed[False], timed[True]))
    return statistics.median(timed[False]), guards, managers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=20, help="pairs of blocks (guarded, skipped)")
    parser.add_argument("--calls", type=int, default=100, help="compiled forwards per block")
    parser.add_argument("--runs", type=int, default=2, help="processes per case, plain and recorded in turn")
    parser.add_argument("--d-model", type=int, default=16)
    parser.add_argument("--case", choices=["plain", "recorded"], help=argparse.SUPPRESS)  # (one run, in this process)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(guard_cost(args.case == "recorded", args.pairs, args.calls, args.d_model)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results: dict[str, list] = {"plain": [], "recorded": []}
    for _ in range(args.runs):
        for case in results:
            out = subprocess.run([sys.executable, "-m", "benchmarks.guard_eval", "--case", case, "--pairs", str(args.pairs),
                                  "--calls", str(args.calls), "--d-model", str(args.d_model)],
                                 capture_output=True, text=True, check=True, env=env).stdout
            results[case].append(json.loads(out.strip().splitlines()[-1]))
    print(f"| compiled forward (12 layers, d={args.d_model}) | ms per forward | guard evaluation, each run | guard managers |")
    print("|---|---|---|---|")
    for case, runs in results.items():
        total = statistics.median(r[0] for r in runs)
        guards = ", ".join(f"{r[1]:.3f} ms" for r in runs)
        print(f"| {case} | {total:.3f} ms | {guards} | {runs[0][2]} |")


if __name__ == "__main__":
    main()
