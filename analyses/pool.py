"""Every analysis's runs in one pool, each distinct training run once (``python -m analyses``).

Analyses plan some of the same runs: ``residual_shrink`` records the Post-LN runs of the
deep setting that ``convergence`` trains, ``cosine`` measures its shallow runs once trained.
:func:`run_all` gathers the plans of every analysis, trains each distinct run once, hands
each analysis the tables its own run would have given, and concludes, draws and publishes an
analysis as soon as its last run is in (the pool keeps working on the others).

Two requests share a training when they train the same model from the same seed with the
same recipe on the same task (:func:`training_key`) and at most one of them records
quantities during training: the training is then the recording one's. A recorder never
changes the training (bit-identical parameters, docs/capture.md), so a request that records
nothing gets exactly the loss, lr and validation rows of a run of its own (:func:`loop_rows`);
snapshots of the trained model are taken
per request. ``tests/test_analysis_pool.py`` checks every table against the analysis run alone.

Jobs go to the pool longest first (steps × layers), so no core idles at the end of one
analysis while another waits. An analysis that overrides ``collect`` runs its own way (one job
per run, unshared); one that keeps state on itself (``runs_apart = False``) runs here after
the pool.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from analyses.runner import Analysis, finish, run, session
from analyses.runs import Bench, RunSpec, Trained, TrainRequest
from gradscope.table import make_frame
from gradscope.train.history import LOOP_QUANTITIES


@dataclass(frozen=True)
class Share:
    """One analysis's part of a job: which run of whose plan (analysis and plan index), and
    what it asked for (None: the analysis's own ``collect``)."""

    analysis: int
    index: int
    spec: RunSpec
    request: TrainRequest | None


@dataclass(frozen=True)
class Job:
    """One training (or one custom run) and the shares it serves."""

    bench: Bench
    shares: tuple[Share, ...]
    collect: Callable[[RunSpec, Bench], list[pd.DataFrame]] | None = None

    @property
    def cost(self) -> float:
        """Steps × layers, to send the longest jobs first."""
        model, train = self.spec.model, self.spec.train
        layers = {"decoder": model.n_dec, "encoder": model.n_enc}.get(model.arch, model.n_enc + model.n_dec)
        return (train.steps if train is not None else 1) * (layers + 1)

    @property
    def lead(self) -> Share:
        """The share whose training this is: the one that records quantities, else the first."""
        return self.recording or self.shares[0]

    @property
    def spec(self) -> RunSpec:
        return self.lead.spec

    @property
    def recording(self) -> Share | None:
        """The share whose request records quantities, if any."""
        return next((s for s in self.shares if s.request is not None and s.request.quantities), None)


def training_key(request: TrainRequest, bench: Bench) -> tuple:
    """What sets a training bit for bit: model, recipe, seed, task, batch and device."""
    spec = request.spec
    return (spec.model, spec.train, bench.seed_of(spec), repr(bench.task), bench.batch_size, str(bench.device))


def plan_jobs(analyses: Sequence[Analysis], benches: Sequence[Bench]) -> list[Job]:
    """The jobs of every analysis that may run apart, shared where :func:`training_key` allows."""
    jobs: list[Job] = []
    open_jobs: dict[tuple, list[int]] = {}  # training key -> indices of jobs it may join
    for a, (analysis, bench) in enumerate(zip(analyses, benches)):
        custom = type(analysis).collect is not Analysis.collect
        for i, spec in enumerate(analysis.plan()):
            if custom:
                jobs.append(Job(bench, (Share(a, i, spec, None),), collect=analysis.collect))
                continue
            request = analysis.request(spec)
            key, share = training_key(request, bench), Share(a, i, spec, request)
            for j in open_jobs.get(key, []):
                if not (request.quantities and jobs[j].recording is not None):
                    jobs[j] = dataclasses.replace(jobs[j], shares=(*jobs[j].shares, share))
                    break
            else:
                open_jobs.setdefault(key, []).append(len(jobs))
                jobs.append(Job(bench, (share,)))
    return jobs


def loop_rows(trained: Trained, run: str) -> pd.DataFrame:
    """The rows a run of its own, without a recorder, would hold of a shared ``trained`` run:
    the training loop's, as :class:`gradscope.train.history.History` stores them."""
    if trained.training_rows is None:
        return make_frame([])
    rows = trained.training_rows.loc[trained.training_rows["quantity"].isin(list(LOOP_QUANTITIES))]
    return make_frame([{"run": run, "variant": variant, "step": step, "quantity": quantity, "value": value,
                        "reduction": LOOP_QUANTITIES[quantity]}
                       for variant, step, quantity, value in rows[["variant", "step", "quantity", "value"]].itertuples(
                           index=False)])


def do_job(job: Job) -> tuple[list[list[pd.DataFrame]], float]:
    """Runs ``job``: the tables of each share, in order, and the seconds it took."""
    start = time.perf_counter()
    if job.collect is not None:
        return [job.collect(job.spec, job.bench)], time.perf_counter() - start
    lead = job.lead
    bench, request = job.bench, lead.request
    trained = bench.train(request.spec, quantities=request.quantities, record_every=request.record_every)
    out = []
    for share in job.shares:
        mine = share.request
        table = trained.table.assign(run=mine.spec.run) if share is lead else loop_rows(trained, mine.spec.run)
        out.append([table, *bench.snapshots(trained.model, mine.spec, mine.after)])
    return out, time.perf_counter() - start


def run_all(analyses: Sequence[Analysis], args: argparse.Namespace) -> dict[str, float]:
    """Runs ``analyses`` as :func:`analyses.runner.run` would one by one, with their runs in
    one pool of ``args.workers`` processes (here, one after another, for 1 worker or a GPU).

    Returns:
        Each analysis's compute in seconds (the sum of its jobs'; a shared job counts for the
        analysis that recorded it, or the first that asked for it).
    """
    with session(args, "all analyses' runs") as device:
        benches = [Bench(task=a.task(args.seed), device=device, batch_size=a.preset.batch_size, seed=args.seed,
                         progress=False) for a in analyses]
        apart = [a.runs_apart for a in analyses]
        jobs = sorted(plan_jobs([a for a, ok in zip(analyses, apart) if ok], [b for b, ok in zip(benches, apart) if ok]),
                      key=lambda job: -job.cost)
        pooled = [a for a, ok in zip(analyses, apart) if ok]
        tables: list[dict[int, list[pd.DataFrame]]] = [{} for _ in pooled]
        waiting = [len(a.plan()) for a in pooled]
        seconds = {type(a).name: 0.0 for a in analyses}
        bar = tqdm(total=len(jobs), desc=f"runs of {len(pooled)} analyses ({args.workers} workers)", unit="run",
                   disable=True if args.no_progress else None)

        def take(job: Job, result: tuple[list[list[pd.DataFrame]], float]) -> None:
            parts, took = result
            seconds[type(pooled[job.lead.analysis]).name] += took
            bar.update()
            for share, frames in zip(job.shares, parts):
                tables[share.analysis][share.index] = frames
                waiting[share.analysis] -= 1
                if not waiting[share.analysis]:
                    analysis = pooled[share.analysis]
                    by_plan = tables[share.analysis]
                    finish(analysis, [f for i in sorted(by_plan) for f in by_plan[i]], args)
                    tables[share.analysis] = {}

        for a, n in enumerate(waiting):  # (an analysis that plans nothing)
            if not n:
                finish(pooled[a], [], args)
        if args.workers <= 1 or device.type != "cpu":
            for job in jobs:
                take(job, do_job(job))
        else:
            context = multiprocessing.get_context("spawn")  # (fork after torch's thread pools started can hang)
            with ProcessPoolExecutor(args.workers, mp_context=context, initializer=torch.set_num_threads,
                                     initargs=(args.threads,)) as pool:
                futures: dict[Future, Job] = {pool.submit(do_job, job): job for job in jobs}
                try:
                    for future in as_completed(futures):
                        take(futures[future], future.result())
                except BaseException:
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
        bar.close()
    for analysis, ok in zip(analyses, apart):
        if not ok:  # (keeps state on itself: runs here, as `python -m analyses.<name>` runs it)
            start = time.perf_counter()
            run(type(analysis), args)
            seconds[type(analysis).name] = time.perf_counter() - start
    return seconds
