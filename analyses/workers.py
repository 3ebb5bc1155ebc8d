"""Running an analysis's runs side by side: one single-thread worker process per core.

The models of the presets are small (d=64): on a 2-core CPU a second torch thread inside one
process speeds a run up by far less than a second process running another run does (issue 49:
"the 2 cores used as two single-thread worker processes"). :func:`collect_runs` hands each
planned run to a pool of ``workers`` processes and gives back the tables in the plan's order,
so the result is the one a serial run gives: every run seeds its own init, data and dropout
(:class:`analyses.runs.Bench`) and runs with the same thread count either way.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from typing import TYPE_CHECKING

import pandas as pd
import torch
from tqdm.auto import tqdm

from analyses.runs import Bench, RunSpec

if TYPE_CHECKING:
    from analyses.runner import Analysis


def collect_runs(analysis: Analysis, specs: Sequence[RunSpec], bench: Bench, *, workers: int, threads: int,
                 progress: bool) -> list[pd.DataFrame]:
    """Every table ``analysis.collect`` makes of ``specs``, in the plan's order.

    Args:
        analysis: the analysis; its runs go to worker processes only when
            ``analysis.runs_apart`` (its :meth:`collect` keeps nothing on the analysis).
        specs: the planned runs.
        bench: where the runs are built and trained.
        workers: processes; 1 (or a single run, or a GPU) runs them here, one after another.
        threads: torch CPU threads in each worker (those of this process otherwise).
        progress: a bar over the runs (the per-run bars are hidden inside workers).

    Raises:
        Whatever a run raises; the runs not yet started are cancelled.
    """
    name = type(analysis).name
    if workers <= 1 or len(specs) <= 1 or not analysis.runs_apart or bench.device.type != "cpu":
        runs = tqdm(specs, desc=f"{name} runs", unit="run", disable=True if not progress else None)
        return [part for spec in runs for part in analysis.collect(spec, bench)]
    quiet = dataclasses.replace(bench, progress=False)
    context = multiprocessing.get_context("spawn")  # (fork after torch's thread pools started can hang)
    with ProcessPoolExecutor(min(workers, len(specs)), mp_context=context, initializer=torch.set_num_threads,
                             initargs=(threads,)) as pool:
        futures: list[Future] = [pool.submit(analysis.collect, spec, quiet) for spec in specs]
        try:
            bar = tqdm(as_completed(futures), total=len(futures), desc=f"{name} runs ({workers} workers)", unit="run",
                       disable=True if not progress else None)
            for future in bar:
                future.result()  # (raises a failed run's error at once)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return [part for future in futures for part in future.result()]
