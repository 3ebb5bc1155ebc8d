"""Across ranks, the routing counts are summed before any ratio: two gloo ranks, each routing
its half of a batch through one Mixtral, record the routing statistics of the whole batch,
computed here in one process from the model's own router logits on the whole batch."""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

import gradscope
from gradscope.recorder.discovery.routers import find_routers

sys.path.insert(0, str(Path(__file__).parent))
from test_moe_routing import B, T, V, build, routing_reference  # noqa: E402

WORLD = 2
BATCH = 2 * B  # (B sequences per rank)


def batch() -> torch.Tensor:
    return torch.randint(0, V, (BATCH, T), generator=torch.Generator().manual_seed(3))


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        model = build("mixtral", layers=2)  # (the same seed: the same weights on both ranks)
        x = batch()[rank * B:(rank + 1) * B]
        rec = gradscope.Recorder(model, quantities=["moe_load", "moe_imbalance", "moe_load_cv", "router_entropy",
                                                    "router_z", "router_topk_mass"])
        with rec.step(0):
            model(x, labels=x).loss.backward()
        rec.close()
        rec.frame().to_parquet(Path(out, f"rank{rank}.parquet"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out, f"left-{rank}").touch()
    if rank == 0:  # (rank 0 hosts the store: it leaves last)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(Path(out, f"left-{r}").exists() for r in range(WORLD)):
            time.sleep(0.01)
    sys.stdout.flush()
    os._exit(0)


def test_counts_are_summed_over_ranks_before_the_ratios(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(port, str(tmp_path)), nprocs=WORLD, join=True)
    frames = [pd.read_parquet(tmp_path / f"rank{r}.parquet") for r in range(WORLD)]
    model = build("mixtral", layers=2)
    with torch.no_grad():
        whole = model(batch(), output_router_logits=True).router_logits
        half = model(batch()[:B], output_router_logits=True).router_logits
    routers = find_routers(model)
    differs = False
    for df in frames:
        for r, logits, local in zip(routers, whole, half):
            want, alone = routing_reference(logits, r.module.top_k), routing_reference(local, r.module.top_k)
            for quantity, value in want.items():
                rows = df[(df["quantity"] == quantity) & (df["site"] == r.block)].sort_values("layer_j")
                got = torch.tensor(rows["value"].to_numpy(), dtype=torch.float64)
                torch.testing.assert_close(got, value.reshape(-1), rtol=1e-5, atol=1e-6, msg=f"{quantity} {r.block}")
                differs |= not torch.allclose(alone[quantity].reshape(-1), value.reshape(-1), rtol=1e-3)
    assert differs  # (one rank's half alone gives other values: the test sees whether ranks were combined)
