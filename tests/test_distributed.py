"""Under DDP and FSDP2 (2 CPU processes, gloo) the recorder's global numbers equal a
single-process run on the whole batch, computed here with plain autograd (1e-5 relative).

One ``torch.multiprocessing.spawn`` runs both wrappers (one process group, DDP then
FSDP2); each rank gets half of one batch and rank 0 writes the gathered table. The
reference is the same model (same seed) on the whole batch in this process. The torchrun
example (``python -m gradscope.distributed_demo``) runs once under ``torch.distributed.run``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradscope
from gradscope.distributed import gather_frame, global_act_grad_norms, global_rows
from gradscope.table import make_frame
from recorder_ref import assert_rel, site_gradients
from spike_ranks import assert_replayed_on_every_rank, spike_replay_on_every_rank

WORLD, B, LR = 2, 4, 0.1  # world size, global batch (2 rows per rank), SGD step of update_ratio
MODES = ("ddp", "fsdp2")


def model_and_batch():
    """The model (seed 0, identical on every rank) and one whole batch with fixed targets."""
    torch.manual_seed(0)
    model = gradscope.build_model(gradscope.presets.tiny(variant="pre_ln", dropout=0.0))
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab
    src, tgt = torch.randint(3, vocab, (B, 7), generator=g), torch.randint(3, vocab, (B, 6), generator=g)
    return model, (src, tgt), torch.randint(0, vocab, (B, 6), generator=g)


def loss_fn(logits, target):
    """Mean over every position (no padding), so each rank averages the same number of terms."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


# -- the two ranks ---------------------------------------------------------------------------
def _worker(rank: int, port: int, out: str) -> None:
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        counts = {mode: _train_one_step(mode, rank, out) for mode in MODES}
        for steps_before in (0, 1):
            _recorder_made_before_fully_shard_passes_on_no_view(rank, steps_before)
        spike = spike_replay_on_every_rank("ddp")
        placements = _placement_norms(rank)
        if rank == 0:
            with open(os.path.join(out, "all_reduce_calls.json"), "w") as f:
                json.dump(counts, f)
            with open(os.path.join(out, "placements.json"), "w") as f:
                json.dump(placements, f)
            with open(os.path.join(out, "spike.json"), "w") as f:
                json.dump(spike, f)
        dist.barrier()  # rank 0 hosts the store: no rank may still use it when rank 0 leaves
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: it destroys what still holds gloo's C++ state
    # (FSDP states, DTensors) in arbitrary order, which once aborted a rank after all its work
    # was written ("terminate called without an active exception", 1 full-suite run in ~10).
    # Rank 0, which hosted the store, leaves last.
    Path(out, f"left-{rank}").touch()
    if rank == 0:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(Path(out, f"left-{r}").exists() for r in range(WORLD)):
            time.sleep(0.01)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _train_one_step(mode: str, rank: int, out: str) -> int:
    """One recorded SGD step on this rank's half of the batch; returns all_reduce calls in the step."""
    model, inputs, target = model_and_batch()
    mine = slice(rank * B // WORLD, (rank + 1) * B // WORLD)
    inputs, target = tuple(t[mine] for t in inputs), target[mine]
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        early = gradscope.Recorder(model, quantities=["param_grad_norm"])  # built before fully_shard swaps parameters
        for stack in model.stacks().values():
            for layer in stack.layers:
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rec = gradscope.Recorder(model, quantities="all", slow_every=1, optimizer=opt, run=mode)
    calls, all_reduce = [0], dist.all_reduce

    def counting(*args, **kwargs):
        calls[0] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with rec.step(0):
                loss = loss_fn(model(*inputs), target)
                loss.backward()
                rec.log("loss", loss)
        # (fully_shard warns when a wrapped module returns a view: the recorder must not make one)
        assert not [w for w in caught if "view tensor" in str(w.message)], [str(w.message) for w in caught]
        if mode == "fsdp2":
            with early.step(0):
                pass  # reads the same p.grad: checks the live parameter list
    finally:
        dist.all_reduce = all_reduce
    opt.step()
    if mode == "ddp":
        rec.save(os.path.join(out, f"{mode}.parquet"), gather=True)  # collective; rank 0 writes
        rec.close()
    else:
        df = rec.frame(gather=True)
        early_df = gather_frame(early)
        if rank == 0:
            gradscope.save_frame(df, os.path.join(out, f"{mode}.parquet"))
            gradscope.save_frame(early_df, os.path.join(out, f"{mode}_early.parquet"))
        else:
            assert df is None and early_df is None
        rec.close()
        early.close()
    return calls[0]


def _recorder_made_before_fully_shard_passes_on_no_view(rank: int, steps_before: int) -> None:
    """A Recorder (default quantities) made before ``fully_shard``, which may have recorded
    ``steps_before`` steps of the unsharded model: its sites pass on no view in a recorded
    step after it (fully_shard warns of a view a wrapped module returns)."""
    from torch.distributed.fsdp import fully_shard

    model, inputs, target = model_and_batch()
    rec = gradscope.Recorder(model)
    for step in range(steps_before):  # (each rank alone: the model is not sharded yet)
        with rec.step(step):
            loss_fn(model(*inputs), target).backward()
        model.zero_grad(set_to_none=True)
    for stack in model.stacks().values():
        for layer in stack.layers:
            fully_shard(layer)
    fully_shard(model)
    mine = slice(rank * B // WORLD, (rank + 1) * B // WORLD)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rec.step(steps_before):
            loss_fn(model(*(t[mine] for t in inputs)), target[mine]).backward()
    rec.close()
    assert not [w for w in caught if "view tensor" in str(w.message)], (steps_before, [str(w.message) for w in caught])
    grads = rec.frame().query("quantity == 'act_grad_norm' and step == @steps_before and micro_step == -1")["value"]
    assert len(grads) > 0 and np.isfinite(grads).all(), steps_before


def placement_tensors(rank: int) -> dict[str, torch.Tensor]:
    """Full tensors (the same on every rank), and rank ``rank``'s addend of the Partial one."""
    g = torch.Generator().manual_seed(2)
    full = {name: torch.randn(5, 3, generator=g) for name in ("shard", "replicate", "plain")}  # 5 rows: uneven shards
    addends = [torch.randn(4, generator=g) for _ in range(WORLD)]
    return {**full, "partial": addends[rank], "partial_sum": sum(addends)}


def _placement_norms(rank: int) -> dict[str, float]:
    """Squared global norms through ``params.local`` + ``reduce_squared_norms`` for each placement."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from gradscope.distributed import reduce_squared_norms
    from gradscope.recorder.capture.params import local

    mesh = init_device_mesh("cpu", (WORLD,))
    t = placement_tensors(rank)
    tensors = [distribute_tensor(t["shard"], mesh, [Shard(0)]), distribute_tensor(t["replicate"], mesh, [Replicate()]),
               t["plain"], DTensor.from_local(t["partial"], mesh, [Partial()]), None]
    sq = torch.tensor([float(local(x).norm()) ** 2 if x is not None else 0.0 for x in tensors])
    return dict(zip(["shard", "replicate", "plain", "partial", "none"], reduce_squared_norms(tensors, sq).tolist()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    torch.multiprocessing.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    tables = {m: gradscope.load(out / f"{m}.parquet") for m in MODES}
    tables["fsdp2_early"] = gradscope.load(out / "fsdp2_early.parquet")
    tables["placements"] = json.loads((out / "placements.json").read_text())
    tables["spike"] = json.loads((out / "spike.json").read_text())
    return tables, json.loads((out / "all_reduce_calls.json").read_text())


@pytest.fixture(scope="module")
def reference():
    """Single process, whole batch: site gradients via autograd.grad, parameter gradients via p.grad."""
    model, inputs, target = model_and_batch()
    sites = {n: (m, "output") for n, m in model.named_modules() if isinstance(m, gradscope.Site)}
    act_grad, values = site_gradients(model, sites, lambda: loss_fn(model(*inputs), target))
    loss = loss_fn(model(*inputs), target)
    loss.backward()
    params = dict(model.named_parameters())
    grad_sq = {n: p.grad.norm().item() ** 2 for n, p in params.items()}
    group = lambda prefix: math.sqrt(sum(v for n, v in grad_sq.items() if not prefix or n.startswith(prefix + ".")))
    theta = math.sqrt(sum(p.detach().norm().item() ** 2 for p in params.values()))
    return {
        "act_grad": act_grad,
        "act": {n: v.norm().item() for n, v in values.items()},
        "param": group,
        "loss": loss.item(),
        "update_ratio": LR * group("") / theta,  # SGD: ‖Δθ‖ = lr·‖g‖
    }


def _values(df, quantity, rank=-1):
    rows = df[(df.quantity == quantity) & (df["rank"] == rank) & (df.micro_step == -1)]
    assert not rows.duplicated(["site"]).any(), f"{quantity}: several rows per site"
    return dict(zip(rows.site, rows.value))


# -- the tests -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_every_rank_reaches_one_table(ranks_out, mode):
    df = ranks_out[0][mode]
    assert sorted(df["rank"].unique()) == [0, 1]
    per_rank = df.groupby("rank").size()
    assert per_rank[0] == per_rank[1] > 0
    assert set(df["run"]) == {mode}


@pytest.mark.parametrize("mode", MODES)
def test_param_grad_norm_is_global_on_every_rank(ranks_out, reference, mode):
    df = ranks_out[0][mode]
    groups = None
    for rank in (0, 1):
        got = _values(df, "param_grad_norm", rank)
        groups = groups or set(got)
        assert set(got) == groups and "" in groups and "decoder.layers.1.ffn" in groups
        for prefix, value in got.items():
            assert_rel(value, reference["param"](prefix), what=f"{mode} rank {rank} {prefix!r}")
    ratio = _values(df, "update_ratio", 0)[""]
    assert_rel(ratio, reference["update_ratio"], what=f"{mode} update_ratio")


@pytest.mark.parametrize("mode", MODES)
def test_global_act_grad_norm_equals_whole_batch(ranks_out, reference, mode):
    df = ranks_out[0][mode]
    glob = global_act_grad_norms(df, WORLD)
    assert set(glob["rank"]) == {-1} and set(glob["quantity"]) == {"act_grad_norm"}
    got = _values(glob, "act_grad_norm")
    assert set(got) == set(reference["act_grad"]) and len(got) > 20
    for site, value in got.items():
        assert_rel(value, reference["act_grad"][site], what=f"{mode} {site}")
    per_rank = _values(df, "act_grad_norm", 0)
    assert all(per_rank[s] > got[s] for s in got)  # a rank's own ∂loss_r/∂h is W·(its share): never the global value


@pytest.mark.parametrize("mode", MODES)
def test_global_act_norm_and_loss_equal_whole_batch(ranks_out, reference, mode):
    glob = global_rows(ranks_out[0][mode])
    for site, value in _values(glob, "act_norm").items():
        assert_rel(value, reference["act"][site], what=f"{mode} {site}")
    assert_rel(_values(glob, "loss")[""], reference["loss"], what=f"{mode} loss")
    assert_rel(_values(glob, "param_grad_norm")[""], reference["param"](""), what=f"{mode} param")


def test_fsdp2_one_all_reduce_per_recorded_step(ranks_out, reference):
    tables, calls = ranks_out
    assert calls == {"ddp": 0, "fsdp2": 2}  # FSDP2: the main recorder and the early one, one each
    early = tables["fsdp2_early"]
    assert_rel(_values(early, "param_grad_norm", 1)[""], reference["param"](""), what="recorder built before fully_shard")


def test_squared_norms_count_shards_once_and_replicas_once(ranks_out):
    got, t = ranks_out[0]["placements"], placement_tensors(0)
    for name in ("shard", "replicate", "plain"):
        assert_rel(got[name], t[name].norm().item() ** 2, what=name)
    assert_rel(got["partial"], t["partial_sum"].norm().item() ** 2, what="partial (pending sum)")
    assert got["none"] == 0.0


# -- pure functions (no process group) -------------------------------------------------------
def _table(values, quantity="act_grad_norm", reduction="mean"):
    return make_frame({"rank": r, "site": "s", "stack": "", "quantity": quantity, "value": v, "step": 0,
                       "reduction": reduction} for r, v in enumerate(values))


def test_global_rows_factor_follows_reduction():
    assert_rel(global_rows(_table([3.0, 4.0])).value.item(), 5.0 / 2)
    assert_rel(global_rows(_table([3.0, 4.0], reduction="sum")).value.item(), 5.0)
    assert_rel(global_rows(_table([3.0, 4.0]), reduction="sum").value.item(), 5.0)
    assert_rel(global_rows(_table([1.0, 2.0, 6.0], "loss")).value.item(), 3.0)
    assert math.isnan(global_rows(_table([3.0, float("nan")])).value.item())


def test_global_rows_refuse_missing_ranks():
    with pytest.raises(ValueError, match="world_size=4"):
        global_rows(_table([3.0, 4.0]), world_size=4)
    two_sites = pd.concat([_table([3.0, 4.0]), _table([1.0]).assign(site="t")])
    with pytest.raises(ValueError, match="1 rank rows, expected 2$"):
        global_rows(two_sites)
    other_steps = pd.concat([_table([3.0, 4.0]), _table([1.0]).assign(step=1)])  # rank 0 recorded step 1 too
    with pytest.raises(ValueError, match=r"recorded different steps \(rank 0: \[0, 1\]; rank 1: \[0\]\)"):
        global_rows(other_steps)


def test_gather_without_process_group_is_the_own_frame():
    df = _table([1.0])
    assert gather_frame(df) is df


def test_global_rows_keep_the_sites_role():
    df = pd.concat([_table([3.0, 4.0]).assign(role="layer_out"), _table([2.0, 2.0], "loss").assign(site="")])
    assert dict(zip(global_rows(df)["quantity"], global_rows(df)["role"])) == {"act_grad_norm": "layer_out", "loss": ""}


# -- the torchrun example ---------------------------------------------------------------------
def test_demo_under_torchrun_writes_every_ranks_rows(tmp_path):
    out = tmp_path / "ddp.parquet"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"} if sys.platform == "linux" else None
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
                          "-m", "gradscope.distributed_demo", "--steps", "2", "--batch-size", "4", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"ddp, {WORLD} ranks" in run.stdout and "step 2: loss" in run.stdout
    df = gradscope.load(out)
    assert sorted(df["rank"].unique()) == [0, 1] and sorted(df["step"].unique()) == [1, 2]


def test_demo_outside_torchrun_says_how_to_launch(monkeypatch):
    from gradscope import distributed_demo

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="torchrun --nproc-per-node 2 -m gradscope.distributed_demo"):
        distributed_demo.main(["--steps", "1"])


def test_gpu_check_has_help_and_says_how_to_launch(monkeypatch, capsys):
    """benchmarks/cuda_dist_check.py (for a GPU machine; its CPU path is tests/test_distributed_meshes.py's
    checks): it imports, --help lists its layouts, and outside torchrun it says how to launch."""
    from benchmarks import cuda_dist_check

    with pytest.raises(SystemExit) as exit_help:
        cuda_dist_check.main(["--help"])
    assert exit_help.value.code == 0 and "hsdp_tp" in capsys.readouterr().out
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit):
        cuda_dist_check.main(["--device", "cpu"])
    assert "torchrun --nproc-per-node 4 -m benchmarks.cuda_dist_check" in capsys.readouterr().err


def test_a_spike_on_one_rank_is_replayed_on_every_rank(ranks_out):
    """DDP, 2 ranks, rank 0's loss ×1e3 at one step: both ranks flag it from the ranks' mean
    (one all_reduce of the watch's two numbers) and replay it; each rank's replayed rows equal
    its always-recording run's to 1e-6; training clipped with rec.grad_norm equals training
    without the recorder clipped with clip_grad_norm_, bit for bit (tests/spike_ranks.py)."""
    assert_replayed_on_every_rank(ranks_out[0]["spike"], WORLD)
