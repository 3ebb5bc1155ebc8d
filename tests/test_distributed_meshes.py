"""On device meshes of 4 CPU processes (gloo), every row the recorder writes equals a
single-process run of the same weights and batch (its own Recorder on a plain copy, 1e-6
relative), every parameter group's gradient norm equals the copy's ``p.grad`` norms, and
``rec.grad_norm`` the copy's total norm; training with the recorder (clipped with
``rec.grad_norm``) is bit-identical to training without it. Layouts: tensor parallelism alone,
FSDP2 over tensor parallelism (a 2-D mesh, whose parameters are ``_StridedShard`` over ``dp``:
their groups read 1/√2 of the true norm before, issue 51) and HSDP (replicate × shard); models:
a residual MLP stack and a HuggingFace Llama built from its config, tensor-parallel in its
attention (q/k/v column-wise, o row-wise) and MLP (gate/up column-wise, down row-wise).

One spawn runs every layout and model (and the FSDP2 spike replay of tests/spike_ranks.py);
rank 0 writes what it measured, and the tests read it."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import sys
import warnings
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradscope
from gradscope.recorder.quantities.registry import ALL_QUANTITIES, SIGNAL_QUANTITIES
from gradscope.recorder.replay import ranks
from spike_ranks import assert_replayed_on_every_rank, spike_replay_on_every_rank

WORLD, D, MAX_NORM = 4, 16, 0.5
LAYOUTS = ("tp", "fsdp_tp", "hsdp", "3d_replicate", "3d_shard")
MESHES_3D = {"3d_replicate": (2, 1, 2), "3d_shard": (1, 2, 2)}  # (replicate, shard, tp): HSDP over TP
MODELS = ("mlp", "llama")
QUANTITIES = [*ALL_QUANTITIES, *SIGNAL_QUANTITIES]  # every built-in that reads a step
KEY = ["stack", "layer", "site", "quantity", "layer_j", "role"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return self.head(x).square().mean()


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=40, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def _build(name: str) -> tuple[nn.Module, list[nn.Module], dict, object]:
    """The model (seed 0), its blocks, their tensor-parallel plan, and the step's loss function."""
    torch.manual_seed(0)
    if name == "mlp":
        model = Net()
        x = torch.randn(4, 5, D, generator=torch.Generator().manual_seed(1))
        return model, list(model.layers), {"up": "col", "down": "row"}, lambda m: m(x)
    model = llama()
    tokens = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    plan = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col", "self_attn.o_proj": "row",
            "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"}
    return model, list(model.model.layers), plan, lambda m: m(input_ids=tokens, labels=tokens).loss


def _parallel(model: nn.Module, blocks: list[nn.Module], plan: dict, layout: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if layout in MESHES_3D:
        mesh = init_device_mesh("cpu", MESHES_3D[layout], mesh_dim_names=("replicate", "shard", "tp"))
        dp = mesh["replicate", "shard"]
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
    styles = {"col": ColwiseParallel, "row": RowwiseParallel}
    for block in blocks:
        parallelize_module(block, mesh["tp"], {name: styles[s]() for name, s in plan.items()})
    if layout != "tp":
        for block in blocks:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _rows(rec) -> "pd.Series":  # noqa: F821
    df = rec.frame()
    return df.set_index(KEY).value.sort_index()


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss


def _one_layout(layout: str, name: str) -> dict:
    """The recorded and the plain parallel model, one clipped Adam step each on the same batch
    (the same on every rank), against a single-process copy recorded alike."""
    runs = {}
    for role in ("single", "recorded", "plain"):
        model, blocks, plan, loss_of = _build(name)  # (seed 0: the same weights each time)
        if role != "single":
            model = _parallel(model, blocks, plan, layout)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        rec = None
        if role != "plain":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                rec = gradscope.Recorder(model, optimizer=opt, quantities=QUANTITIES, slow_every=1,
                                         on_spike="replay" if role == "recorded" else None)
                rec.run(0, lambda model=model, loss_of=loss_of: _backward(loss_of(model)))
            unread = {m.group(1) for w in caught for m in [re.search(r"attn_\w+: attention '([^']+)'", str(w.message))] if m}
        else:
            loss_of(model).backward()
        params = list(model.parameters())
        grads = [p.grad for p in params]
        if role == "recorded":
            norm = rec.grad_norm
        else:
            norm = ranks.total_grad_norm(grads)
        one_mesh = len({getattr(g, "device_mesh", None) for g in grads}) == 1
        runs[role] = {"model": model, "rec": rec, "norm": float(ranks.plain(norm)),
                      "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}
        if role == "plain" and one_mesh:  # clip_grad_norm_ (raises on gradients over several meshes)
            runs[role]["clip_norm"] = ranks.plain(torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
        else:
            torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm, foreach=None if one_mesh else False)
        opt.step()
        if rec is not None:
            runs[role]["rows"], runs[role]["unread_attention"] = _rows(rec), sorted(unread)
            rec.close()
    single, recorded, plain = runs["single"], runs["recorded"], runs["plain"]
    rows, reference = recorded["rows"], single["rows"]
    a, b = rows.to_numpy(), reference.reindex(rows.index).to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b) / np.maximum(np.abs(b), 1e-12))
    worst = {}
    for q, r in zip(rows.index.get_level_values("quantity"), rel):
        worst[q] = max(worst.get(q, 0.0), float(r))
    sg = single["grads"]
    groups = rows.xs("param_grad_norm", level="quantity").droplevel(["stack", "layer", "layer_j", "role"])
    worst_group = max(abs(v / math.sqrt(sum(float(g.double().square().sum()) for n, g in sg.items()
                                            if not s or n.startswith(f"{s}."))) - 1) for s, v in groups.items())
    return {
        "keys_only_here": sorted(map(str, set(rows.index) - set(reference.index))),
        "keys_only_single": sorted({(k[2], k[3]) for k in set(reference.index) - set(rows.index)}),
        "unread_attention": recorded["unread_attention"],
        "placements": sorted({str(p.placements) for p in recorded["model"].parameters() if hasattr(p, "placements")}),
        "worst": worst,
        "groups": sorted(groups.index),
        "worst_group": worst_group,
        "grad_norm_rel": abs(recorded["norm"] / single["norm"] - 1),
        "grad_norm_is_clip_grad_norm": (bool(torch.equal(ranks.plain(runs["recorded"]["rec"].grad_norm), plain["clip_norm"]))
                                        if "clip_norm" in plain else None),
        "same": all(torch.equal(_local(p), _local(q)) for p, q in zip(recorded["model"].parameters(),
                                                                     plain["model"].parameters())),
    }


def _sequence_parallel() -> dict:
    """The MLP stack with sequence parallelism on the ``tp`` dimension (SequenceParallel norms
    and head, the residual stream a slice of the sequence on each rank), one clipped SGD step
    recorded and one without, against a single-process copy on the whole sequence."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    x = torch.randn(4, 6, D, generator=torch.Generator().manual_seed(1))
    mine = x.chunk(2, dim=1)[mesh.get_local_rank()]  # (B, T/2, D)
    runs = []
    for recorded in (True, False):
        torch.manual_seed(0)
        model = Net()
        for block in model.layers:
            parallelize_module(block, mesh, {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                                             "down": RowwiseParallel(output_layouts=Shard(1))})
        parallelize_module(model, mesh, {"head": SequenceParallel()})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quantities = ["param_grad_norm", "act_grad_norm", "act_norm", "ln_gain"]
            rec = gradscope.Recorder(model, quantities=quantities) if recorded else None
            with rec.step(0) if recorded else contextlib.nullcontext():
                _head_out(model, mine).full_tensor().square().mean().backward()
        params = list(model.parameters())
        norm = ranks.total_grad_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm, foreach=False)
        opt.step()
        runs.append((model, rec.frame() if recorded else None, caught))
    torch.manual_seed(0)
    single = Net()
    single(x).backward()
    (model, df, caught), (plain, _, _) = runs
    grads = {n: p.grad for n, p in single.named_parameters()}
    groups = df[df.quantity == "param_grad_norm"].set_index("site").value
    said = [str(w.message) for w in caught if "passed on a DTensor" in str(w.message)]
    return {
        "worst_group": max(abs(v / math.sqrt(sum(float(g.double().square().sum()) for n, g in grads.items()
                                                 if not s or n.startswith(f"{s}."))) - 1) for s, v in groups.items()),
        "groups": sorted(groups.index),
        "sites": sorted(set(df[df.quantity != "param_grad_norm"].site)),
        "warned": said,
        "same": all(torch.equal(_local(p), _local(q)) for p, q in zip(model.parameters(), plain.parameters())),
    }


def _head_out(model: Net, x: torch.Tensor) -> torch.Tensor:
    """Net's forward up to its head (the loss is taken on the head's DTensor output)."""
    for block in model.layers:
        x = block(x)
    return model.head(x)


def _worker(rank: int, port: int, out: str) -> None:
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    try:
        found = {f"{layout}/{name}": _one_layout(layout, name) for layout in LAYOUTS for name in MODELS}
        found["sp"] = _sequence_parallel()
        found["spike_fsdp2"] = spike_replay_on_every_rank("fsdp2")
        found["spike_hsdp"] = spike_replay_on_every_rank("hsdp")
        if rank == 0:
            with open(out, "w") as f:
                json.dump(found, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path_factory.mktemp("meshes") / "found.json")
    torch.multiprocessing.spawn(_worker, args=(port, out), nprocs=WORLD)
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_row_equals_a_single_process_run(measured, layout, name):
    found = measured[f"{layout}/{name}"]
    assert not found["keys_only_here"], found
    assert all(q.startswith("attn_") for _, q in found["keys_only_single"]), found  # (next test)
    assert {"param_grad_norm", "act_grad_norm", "update_ratio", "grad_rms_over_eps"} <= set(found["worst"]), found
    assert max(found["worst"].values()) <= 1e-6, found["worst"]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_group_norm_equals_the_single_process_gradients(measured, layout, name):
    found = measured[f"{layout}/{name}"]
    expected = {"mlp": {"", "layers.0", "layers.0.up", "layers.0.down", "layers.0.norm", "head"},
                "llama": {"", "model.layers.0.self_attn", "model.layers.1.mlp", "model.norm", "lm_head"}}[name]
    assert expected <= set(found["groups"]), found["groups"]
    assert found["worst_group"] <= 1e-6, found


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grad_norm_is_the_total_norm_and_training_is_bit_identical(measured, layout, name):
    """rec.grad_norm equals the single-process total norm (1e-6); on one mesh (HSDP) it is
    clip_grad_norm_'s own, bit for bit; clipped with it, training equals training without the
    recorder, bit for bit."""
    found = measured[f"{layout}/{name}"]
    if layout in MESHES_3D:  # (a tensor-parallel weight: replicated, FSDP-sharded and TP-sharded)
        assert any(p.count(",") == 2 and "Replicate" in p and "Shard" in p for p in found["placements"]), found
    assert found["grad_norm_rel"] <= 1e-6, found
    assert found["grad_norm_is_clip_grad_norm"] is (True if layout == "hsdp" else None), found
    assert found["same"], found


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_split_over_tensor_parallel_ranks_is_left_out_with_a_warning_naming_it(measured, layout):
    """Under tensor parallelism each rank computes 2 of the Llama's 4 heads: attn_logit_max,
    attn_entropy and attn_sink_mass have no rows there, and a warning names each attention module; under HSDP
    (whole heads on every rank) their rows equal the single-process run's."""
    found = measured[f"{layout}/llama"]
    attention = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    if layout == "hsdp":
        assert found["keys_only_single"] == [] and found["unread_attention"] == [], found
        assert {"attn_logit_max", "attn_entropy", "attn_sink_mass"} <= set(found["worst"]), found
    else:
        assert found["unread_attention"] == attention, found
        assert found["keys_only_single"] == [[s, q] for s in attention for q in ("attn_entropy", "attn_logit_max", "attn_sink_mass")], found


def test_sequence_parallel_activations_are_left_out_with_a_warning_naming_them(measured):
    """SequenceParallel norms pass on DTensors sharded on the sequence: those sites are left out
    (no crash, no rows) and one warning names them; parameter-group norms still equal the
    single-process run's (1e-6), and training is bit-identical with the recorder."""
    found = measured["sp"]
    assert found["worst_group"] <= 1e-6 and {"", "layers.0.norm", "head"} <= set(found["groups"]), found
    assert len(found["warned"]) == 1, found["warned"]
    for name in ("layers.0.norm.in", "layers.0.norm.out", "layers.1.norm.in", "layers.1.norm.out"):
        assert f"'{name}'" in found["warned"][0], found["warned"]
    assert "Shard(dim=1)" in found["warned"][0]
    assert not {s for s in found["sites"] if ".norm" in s}, found["sites"]
    assert found["same"]


def test_a_spike_on_one_rank_is_replayed_on_every_rank_under_fsdp2(measured):
    """FSDP2 over 4 ranks (1-D mesh), rank 0's loss ×1e3 at one step: every rank flags and
    replays it, the replayed rows equal each rank's always-recording run's to 1e-6, and
    training clipped with rec.grad_norm (a DTensor) equals training without the recorder
    clipped with clip_grad_norm_, bit for bit (tests/spike_ranks.py)."""
    assert_replayed_on_every_rank(measured["spike_fsdp2"], WORLD)


def test_a_spike_on_one_rank_is_replayed_on_every_rank_under_hsdp(measured):
    """The same under HSDP (2 replicas × 2 shards): rec.grad_norm is a DTensor on the 2-D mesh."""
    assert_replayed_on_every_rank(measured["spike_hsdp"], WORLD)
