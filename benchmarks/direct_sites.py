"""What reading a zoo Site at the tensor it passes on (no alias) saves a recorded eager step.

A model that promises ``site_inputs_used_only_through_the_site`` (the zoo) has most of its
Sites read at the very tensor they pass on (``SitePlan.direct``, recorder/site_plan.py);
the others, and every Site of any other model, at an alias. Three copies of the d=16
benchmark model train side by side: plain (no recorder ever attached), recorded, and
recorded with an alias at every site (the plan switched off on that Recorder alone). Each
round runs one step of each, the order rotating; a cell is the median over rounds of the
per-round difference, so slow drifts of a shared machine cancel. Timed steps record the
default quantities and are never slow steps.

    python -m benchmarks.direct_sites                 # eager, 300 rounds
    python -m benchmarks.direct_sites --compile       # compiled (direct sites are eager only: ≈ 0 expected)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch

import gradscope
from benchmarks.allocator import steady
from benchmarks.overhead import load_line, machine
from benchmarks.overhead_methods import loss_of, make_batch, make_model, make_optimizer, maybe_compile

KINDS = ("plain", "recorded", "aliases everywhere")
SLOW_EVERY = 10  # timed steps are never multiples of it


def stepper(base: torch.nn.Module, batch, kind: str, compiled: bool) -> tuple[Callable[[int], float], str]:
    """A function that runs training step ``i`` of a fresh copy and returns its seconds, and
    how many of the copy's sites are read directly (``"12 of 150"``)."""
    model = copy.deepcopy(base)
    opt = make_optimizer(model)
    rec = None if kind == "plain" else gradscope.Recorder(model, optimizer=opt, slow_every=SLOW_EVERY)
    if kind == "aliases everywhere":
        rec._capture._direct = [False] * len(rec._capture._direct)
    run = maybe_compile(model, compiled)

    def step(i: int) -> float:
        t0 = time.perf_counter()
        if rec is not None:
            rec.begin_step(i)
        loss_of(run, batch).backward()
        if rec is not None:
            rec.end_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0
    plan = [] if rec is None else rec._capture._direct
    return step, f"{sum(plan)} of {len(plan)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.direct_sites", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300, help="timed rounds of the three copies (default: 300)")
    parser.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) every copy")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"allocator: {steady()}")
    print(machine())
    print(load_line("before"))
    base, batch = make_model(12, 16, "cpu"), make_batch(2, 5, "cpu")
    made = [stepper(base, batch, kind, args.compile) for kind in KINDS]
    steps = [s for s, _ in made]
    for i in range(3):  # step 0 records the slow quantities; both graphs compile when compiled
        for s in steps:
            s(SLOW_EVERY * i)
    times: list[list[float]] = [[] for _ in KINDS]
    for r in range(args.rounds):
        for j in range(r, r + len(KINDS)):  # each copy runs first, second and third in turn
            times[j % len(KINDS)].append(steps[j % len(KINDS)](SLOW_EVERY * (r + 3) + 1))
    plain, direct, aliased = times

    def ms(a: list[float], b: list[float]) -> str:
        return f"{1e3 * statistics.median(x - y for x, y in zip(a, b)):+.2f} ms"
    print(f"6+6 pre_ln, d=16, batch 2×5, {'compiled' if args.compile else 'eager'}, {args.rounds} rounds; "
          f"sites read directly: {made[1][1]}")
    print(f"plain step {1e3 * statistics.median(plain):.2f} ms; recorded {ms(direct, plain)}; "
          f"aliases everywhere {ms(aliased, plain)}; recorded − aliases everywhere {ms(direct, aliased)}")
    print(load_line("after"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
