"""Runnable example of :mod:`gradscope.distributed`: a zoo model trained for a few steps
under DDP or FSDP2 with the recorder; rank 0 saves every rank's rows and prints the
whole-batch (``rank = -1``) loss and gradient norm of the last step.

    torchrun --nproc-per-node 2 -m gradscope.distributed_demo --steps 3 --out runs/ddp.parquet
    torchrun --nproc-per-node 2 -m gradscope.distributed_demo --parallel fsdp2 --out runs/fsdp2.parquet

CPU with gloo by default; ``--device cuda`` uses NCCL with one GPU per rank.
"""

from __future__ import annotations

import argparse
import gc
import os

import pandas as pd
import torch
import torch.distributed as dist

import gradscope
from gradscope.distributed import global_rows
from gradscope.train import label_smoothed_loss, make_task

TASK_FOR_ARCH = {"encoder_decoder": "reverse", "decoder": "markov_lm", "encoder": "markov_mlm"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gradscope.distributed_demo",
                                description="Train a zoo model for a few steps under DDP or FSDP2 with the recorder; "
                                            "rank 0 saves every rank's rows. Launch with torchrun.")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "base"], help="model size (gradscope.presets)")
    p.add_argument("--variant", default="pre_ln", help="wiring, a key of gradscope.VARIANTS")
    p.add_argument("--arch", default="encoder_decoder", choices=sorted(TASK_FOR_ARCH), help="model architecture")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="global batch size, split evenly between ranks")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp2"], help="DistributedDataParallel or fully_shard")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (gloo) or cuda (nccl, one GPU per rank)")
    p.add_argument("--seed", type=int, default=0, help="model seed (the same on every rank)")
    p.add_argument("--out", default="runs/distributed.parquet", help="table written by rank 0")
    return p.parse_args(argv)


def train(args: argparse.Namespace, rank: int, W: int, device: torch.device) -> None:
    """Trains ``args.steps`` steps of this rank's share and saves every rank's rows (collective)."""
    torch.manual_seed(args.seed)  # same initial weights on every rank
    config = gradscope.presets.SIZES[args.preset](variant=args.variant, arch=args.arch, dropout=0.0)
    model = gradscope.build_model(config).to(device)
    if args.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        from torch.distributed.fsdp import fully_shard

        for stack in model.stacks().values():
            for layer in stack.layers:
                fully_shard(layer)
        fully_shard(model)
    task = make_task(TASK_FOR_ARCH[args.arch], vocab=config.vocab, max_len=config.max_len, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    rec = gradscope.Recorder(model, optimizer=opt, run=f"{args.parallel}-w{W}")
    share = args.batch_size // W
    for step in range(1, args.steps + 1):
        batch = task.batch("train", step, args.batch_size)  # the same global batch on every rank
        batch = tuple(t[rank * share:(rank + 1) * share].to(device) for t in batch)  # this rank's rows
        with rec.step(step):
            logits = model(*task.model_inputs(batch))  # (B/W, T, vocab)
            loss = label_smoothed_loss(logits, task.targets(batch), pad_id=task.pad_id, smoothing=0.0)
            loss.backward()
            rec.log("loss", loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    rec.save(args.out, gather=True)  # collective; rank 0 writes every rank's rows
    rec.close()


def main(argv: list[str] | None = None) -> pd.DataFrame | None:
    """Trains under torchrun and saves one table on rank 0; returns it there (None elsewhere)."""
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g.: torchrun --nproc-per-node 2 -m gradscope.distributed_demo --steps 3")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rank, W = dist.get_rank(), dist.get_world_size()
        if args.batch_size % W:
            raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the world size {W}")
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        train(args, rank, W, device)
        # Leave together, with nothing but torch.distributed holding the process group: the DDP
        # reducer, FSDP's states and the recorder die with train()'s frame and their cycles with
        # gc (FSDP's take two passes), so gloo's threads stop in destroy_process_group on every
        # rank, not in the interpreter's teardown (which once aborted a rank: "terminate called
        # without an active exception", 1 CI run).
        while gc.collect():
            pass
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    df = gradscope.load(args.out)
    glob = global_rows(df, W)
    last = glob[glob["step"] == args.steps].set_index(["quantity", "site"])["value"]
    print(f"{args.parallel}, {W} ranks: {len(df)} rows from ranks {sorted(int(r) for r in df['rank'].unique())} -> {args.out}")
    print(f"step {args.steps}: loss {last[('loss', '')]:.4f}, global grad norm {last[('param_grad_norm', '')]:.4g}")
    return df


if __name__ == "__main__":
    main()
