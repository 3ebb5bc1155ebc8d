"""Spike replay across ranks, run inside the multi-process spawns of ``test_distributed.py``
(DDP, 2 ranks) and ``test_distributed_meshes.py`` (FSDP2 and HSDP, 4 ranks); not collected itself.

On every rank: the zoo model (dropout 0.1, its own dropout seed per rank) trained with Adam and
gradient clipping on the rank's own batches, rank 0's loss ×1e3 at one step only, three times
from the same weights:

- ``watched``: ``Recorder(every=1000, on_spike=...)``, clipped with
  ``clip_grads_with_norm_(params, MAX_NORM, rec.grad_norm)``;
- ``always``: every step recorded (slow quantities too), clipped with ``clip_grad_norm_``;
- ``plain``: no recorder, clipped with ``clip_grad_norm_``.

What each rank reports: the steps its watch flagged, the replayed rows against the
always-recording run's (worst relative difference, and whether the row keys are the same),
whether the watched run's parameters equal the plain run's bit for bit, and whether
``rec.grad_norm`` equals ``clip_grad_norm_``'s total norm at every step (bit for bit).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.distributed as dist

import gradscope
from gradscope.recorder.replay.replay import ReplayOptions
from test_spike_replay import KEY, batches, closure_for, zoo

STEPS, SPIKE_AT, MAX_NORM = 14, 11, 1.0
OPTIONS = ReplayOptions(window=16, min_history=8)


def _wrap(model: torch.nn.Module, layout: str) -> torch.nn.Module:
    if layout == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = None  # fsdp2: the world's 1-D mesh; hsdp: replicate × shard
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    for stack in model.stacks().values():
        for layer in stack.layers:
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _value(norm: torch.Tensor) -> torch.Tensor:
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _train(model, data, rank: int, mode: str):
    """Returns (the recorder or None, the parameters' local tensors, each step's total norm,
    the last step's loss)."""
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    rec = None
    if mode == "watched":
        rec = gradscope.Recorder(model, optimizer=opt, quantities="all", every=1000, on_spike=OPTIONS)
    elif mode == "always":
        rec = gradscope.Recorder(model, optimizer=opt, quantities="all", every=1, slow_every=1)
    torch.manual_seed(1 + rank)  # dropout: each rank draws its own masks
    norms = []
    for step, micro in enumerate(data, start=1):
        closure = closure_for(model, micro, spike=step == SPIKE_AT and rank == 0)
        loss = closure() if rec is None else rec.run(step, closure)
        if mode == "watched":
            norm = rec.grad_norm
            torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        norms.append(_value(norm).clone())
        opt.step()
        opt.zero_grad()
    if rec is not None:
        rec.close()
    local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in params]
    return rec, [t.clone() for t in local], norms, float(loss)


def _rows(df, step: int):
    rows = df[(df.step == step) & ~df.quantity.isin(["replay", "replay_mismatch"])]
    return rows.set_index(KEY).value.sort_index()


def spike_replay_on_every_rank(layout: str) -> list[dict]:
    """Runs the three trainings on this rank under ``layout`` ("ddp", "fsdp2" or "hsdp"); returns every
    rank's report (the same list on every rank: one ``all_gather_object``)."""
    rank = dist.get_rank()
    data = batches(n=STEPS, seed=100 + rank)  # each rank its own batches
    base = zoo()
    runs = {mode: _train(_wrap(copy.deepcopy(base), layout), data, rank, mode) for mode in ("watched", "always", "plain")}
    watched, always = runs["watched"][0], runs["always"][0]
    df, ref = watched.frame(micro_steps=True), always.frame(micro_steps=True)
    replayed, reference = _rows(df, SPIKE_AT), _rows(ref, SPIKE_AT)
    same_keys = set(replayed.index) == set(reference.index)
    a = replayed.to_numpy()
    b = reference.reindex(replayed.index).to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b) / np.maximum(np.abs(b), 1e-12))
    report = {
        "rank": rank,
        "own_loss": runs["plain"][3],  # this rank's loss at the last step
        "watch_loss": watched.watch.last.loss,  # what the watch judged: the mean over ranks
        "flagged": [r.step for r in watched.watch.flagged],
        "local_loss_spiked": bool(rank == 0),
        "recorded_steps": sorted(int(s) for s in df.step.unique()),
        "replay_rows": int((df.quantity == "replay").sum()),
        "mismatch_rows": int((df.quantity == "replay_mismatch").sum()),
        "rows": len(replayed),
        "quantities": sorted(set(replayed.index.get_level_values("quantity"))),
        "same_keys": same_keys,
        "worst": float(np.nanmax(rel)) if len(rel) else float("nan"),
        "same_params": all(torch.equal(p, q) for p, q in zip(runs["watched"][1], runs["plain"][1])),
        "grad_norm_is_clip_grad_norm": all(torch.equal(p, q) for p, q in zip(runs["watched"][2], runs["plain"][2])),
        "clipped_steps": sum(float(n) > MAX_NORM for n in runs["plain"][2]),
    }
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return reports


def assert_replayed_on_every_rank(reports: list[dict], world: int) -> None:
    """The checks on the reports of :func:`spike_replay_on_every_rank` (in the test process)."""
    assert [r["rank"] for r in reports] == list(range(world))
    mean_loss = sum(r["own_loss"] for r in reports) / world  # the watch judges the ranks' mean loss
    assert all(abs(r["watch_loss"] / mean_loss - 1) <= 1e-6 for r in reports), reports
    assert abs(reports[0]["own_loss"] / reports[1]["own_loss"] - 1) > 1e-3  # (the ranks' own losses differ)
    for r in reports:
        assert r["flagged"] == [SPIKE_AT] and r["recorded_steps"] == [SPIKE_AT], r
        assert r["replay_rows"] == 1 and r["mismatch_rows"] == 0, r
        assert r["same_keys"] and r["rows"] > 50 and r["worst"] <= 1e-6, r
        assert {"act_grad_norm", "param_grad_norm", "update_ratio", "loss"} <= set(r["quantities"]), r
        assert r["same_params"] and r["grad_norm_is_clip_grad_norm"] and r["clipped_steps"] > 0, r
