"""The recorder under torch.distributed on GPUs (NCCL): the checks of tests/test_distributed_meshes.py
and tests/spike_ranks.py on CUDA devices, for a GPU machine. Launch with torchrun, one GPU per rank:

    torchrun --nproc-per-node 4 -m benchmarks.cuda_dist_check                 # 4 GPUs, NCCL
    torchrun --nproc-per-node 8 -m benchmarks.cuda_dist_check --rel 1e-5      # 8 GPUs: (4, 2) and (2, 2, 2) meshes
    torchrun --nproc-per-node 4 -m benchmarks.cuda_dist_check --device cpu    # the same on CPU (gloo)

Layouts (every rank gets the same batch, so each rank's rows equal one process's on that batch):
``ddp`` and ``fsdp2`` (1-D, the zoo model), ``tp``, ``fsdp_tp`` (2-D, dp × tp), ``hsdp``
(replicate × shard) and ``hsdp_tp`` (3-D, replicate × shard × tp), those on an HF Llama built
from its config with a tensor-parallel plan of its attention and MLP (the zoo's MLP stack
without transformers). Per layout, rank 0 prints one line: the worst relative difference of
every row from a single-GPU Recorder on a plain copy (attention rows under tensor parallelism
are left out, with a warning), of ``rec.grad_norm`` from the copy's total norm, and whether
training clipped with ``rec.grad_norm`` is bit-identical to training without the recorder
clipped alike. Then the spike replay under DDP and FSDP2: rank 0's loss ×1e3 at one step is
flagged and replayed on every rank, rows equal to an always-recording run's. Exit code 1 if
any check fails. TF32 is off; the tolerance ``--rel`` allows for NCCL's summation order.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradscope
from gradscope.recorder.quantities.registry import ALL_QUANTITIES, SIGNAL_QUANTITIES
from gradscope.recorder.replay import ranks
from gradscope.recorder.replay.replay import ReplayOptions

LAYOUTS = ("ddp", "fsdp2", "tp", "fsdp_tp", "hsdp", "hsdp_tp")
KEY = ["micro_step", "stack", "layer", "site", "quantity", "layer_j", "role"]
MAX_NORM = 0.5


def _zoo(device, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = gradscope.presets.tiny(variant="pre_ln", arch="decoder", n_dec=2, vocab=40, d_model=32, d_ff=64,
                                 n_heads=4, dropout=dropout)
    return gradscope.build_model(cfg).to(device)


def _llama(device) -> tuple[torch.nn.Module, list, dict]:
    """A tiny HF Llama (seed 0), its decoder layers and their tensor-parallel plan."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).to(device)
    plan = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col", "self_attn.o_proj": "row",
            "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"}
    return model, list(model.model.layers), plan


def _loss(model, tokens) -> torch.Tensor:
    out = model(tokens[:, :-1])
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _parallel(model, blocks, plan, layout: str, device_type: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if layout == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if layout in ("fsdp2", "hsdp"):
        mesh = None if layout == "fsdp2" else init_device_mesh(device_type, (2, world // 2), mesh_dim_names=("r", "s"))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    shape = {"tp": (world // 2, 2), "fsdp_tp": (world // 2, 2), "hsdp_tp": (2, world // 4, 2)}[layout]
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("dp", "tp") if len(shape) == 2 else ("r", "s", "tp"))
    styles = {"col": ColwiseParallel, "row": RowwiseParallel}
    for block in blocks:
        parallelize_module(block, mesh["tp"], {name: styles[s]() for name, s in plan.items()})
    if layout != "tp":
        dp = mesh["dp"] if len(shape) == 2 else mesh["r", "s"]
        for block in blocks:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    return model


def _build(layout: str, device):
    if layout in ("ddp", "fsdp2"):
        model = _zoo(device)
        return model, [layer for s in model.stacks().values() for layer in s.layers], {}
    try:
        return _llama(device)
    except ImportError:
        model = _zoo(device)
        return model, [layer for s in model.stacks().values() for layer in s.layers], {"ffn.fn.fc1": "col", "ffn.fn.fc2": "row"}


def _step(layout: str, role: str, tokens, device, world: int) -> dict:
    """One clipped Adam step; role "single" (a plain copy), "recorded" or "plain"."""
    model, blocks, plan = _build(layout, device)
    if role != "single":
        model = _parallel(model, blocks, plan, layout, device.type, world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec = None
    if role != "plain":
        rec = gradscope.Recorder(model, optimizer=opt, quantities=[*ALL_QUANTITIES, *SIGNAL_QUANTITIES], slow_every=1,
                                 on_spike="replay" if role == "recorded" else None)
        rec.run(0, lambda: _backward(_loss(model, tokens)))
    else:
        _backward(_loss(model, tokens))
    params = list(model.parameters())
    grads = [p.grad for p in params]
    norm = rec.grad_norm if role == "recorded" else ranks.total_grad_norm(grads)
    one_mesh = len({getattr(g, "device_mesh", None) for g in grads}) == 1
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm, foreach=None if one_mesh else False)
    opt.step()
    out = {"norm": float(ranks.plain(norm)), "params": [_local(p).detach().clone() for p in params]}
    if rec is not None:
        out["rows"] = rec.frame().set_index(KEY).value.sort_index()
        rec.close()
    return out


def _backward(loss):
    loss.backward()
    return loss


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _worst(rows, reference) -> tuple[float, str]:
    common = rows.index.intersection(reference.index)
    a, b = rows[common].to_numpy(), reference[common].to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b) / np.maximum(np.abs(b), 1e-12))
    i = int(np.nanargmax(rel)) if len(rel) else 0
    return (float(rel[i]), str(common[i][3:5])) if len(rel) else (float("nan"), "")


def check_layout(layout: str, device, world: int, rel: float) -> bool:
    tokens = torch.randint(0, 40, (4, 17), generator=torch.Generator().manual_seed(1)).to(device)
    single, recorded, plain = (_step(layout, role, tokens, device, world) for role in ("single", "recorded", "plain"))
    rows, reference = recorded["rows"], single["rows"]
    missing = {k[4] for k in reference.index.difference(rows.index)}
    worst, where = _worst(rows, reference)
    norm_rel = abs(recorded["norm"] / single["norm"] - 1)
    same = all(torch.equal(p, q) for p, q in zip(recorded["params"], plain["params"]))
    extra = len(rows.index.difference(reference.index))
    ok = worst <= rel and norm_rel <= rel and same and not extra and missing <= {"attn_logit_max", "attn_entropy"}
    if dist.get_rank() == 0:
        print(f"{layout:8s} {len(rows)} rows, worst {worst:.1e} at {where}; rec.grad_norm {norm_rel:.1e}; "
              f"bit-identical training {same}; left out {sorted(missing)} -> {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def check_spike(layout: str, device, rel: float, steps: int = 14, spike_at: int = 11) -> bool:
    """Rank 0's loss ×1e3 at ``spike_at``: every rank flags and replays it (rows vs an
    always-recording run), training unchanged (clipped with rec.grad_norm vs clip_grad_norm_)."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    data = [torch.randint(3, 40, (4, 9), generator=g).to(device) for _ in range(steps)]
    base = _zoo(device, dropout=0.1)
    found = {}
    for mode in ("watched", "always", "plain"):
        model = copy.deepcopy(base)
        blocks = [layer for s in model.stacks().values() for layer in s.layers]
        model = _parallel(model, blocks, {}, layout, device.type, dist.get_world_size())
        params = list(model.parameters())
        opt = torch.optim.Adam(params, lr=1e-3)
        rec = None
        if mode != "plain":
            rec = gradscope.Recorder(model, optimizer=opt, quantities="all", every=1000 if mode == "watched" else 1,
                                     slow_every=1, on_spike=ReplayOptions(window=16, min_history=8) if mode == "watched" else None)
        torch.manual_seed(1 + rank)
        for step, tokens in enumerate(data, start=1):
            def closure(tokens=tokens, step=step):
                return _backward(_loss(model, tokens) * (1e3 if step == spike_at and rank == 0 else 1.0))
            closure() if rec is None else rec.run(step, closure)
            if mode == "watched":
                torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, rec.grad_norm)
            else:
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            opt.step()
            opt.zero_grad()
        found[mode] = (rec, [_local(p).detach().clone() for p in params])
        if rec is not None:
            rec.close()
    watched, always = found["watched"][0], found["always"][0]
    df = watched.frame()
    rows = df[(df.step == spike_at) & ~df.quantity.isin(["replay", "replay_mismatch"])].set_index(KEY).value.sort_index()
    ref = always.frame()
    ref = ref[ref.step == spike_at].set_index(KEY).value.sort_index()
    worst, _ = _worst(rows, ref)
    same = all(torch.equal(p, q) for p, q in zip(found["watched"][1], found["plain"][1]))
    flagged = [r.step for r in watched.watch.flagged]
    ok = flagged == [spike_at] and set(rows.index) == set(ref.index) and worst <= rel and same
    oks = [None] * dist.get_world_size()
    dist.all_gather_object(oks, (ok, flagged, worst, same))
    if rank == 0:
        print(f"spike/{layout}: per rank (ok, flagged, worst, bit-identical) {oks}", flush=True)
    return all(o[0] for o in oks)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda (NCCL, one GPU per rank) or cpu (gloo)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS, help="layouts to check")
    p.add_argument("--rel", type=float, default=1e-5, help="relative tolerance against the single-device run")
    p.add_argument("--no-spike", action="store_true", help="skip the spike replay checks (DDP, FSDP2)")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("launch with torchrun, e.g. torchrun --nproc-per-node 4 -m benchmarks.cuda_dist_check")
    warnings.filterwarnings("ignore", message="gradscope: .* has nothing to measure")  # (dlcl_weight, scalenorm_g)
    if int(os.environ["RANK"]) != 0:
        warnings.filterwarnings("ignore", message="gradscope: ")  # (rank 0 says it once)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.device == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world = dist.get_world_size()
    try:
        if world < 4 or world % 4:
            raise SystemExit(f"cuda_dist_check: needs 4 or a multiple of 4 ranks (tp=2 times replicate=2), got {world}")
        results = [check_layout(layout, device, world, args.rel) for layout in args.layouts]
        if not args.no_spike:
            results += [check_spike(layout, device, args.rel) for layout in ("ddp", "fsdp2")]
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
