"""Child process for tests/test_recorder_compile.py: trains one model for 5 Adam steps in
one mode and writes its parameters, table and Dynamo counters to a directory.

Usage: python compile_child.py {pre_ln,post_ln,llama} {plain,recorded,eager} OUT_DIR [QUANTITIES]

``plain``: torch.compile(fullgraph=True), no recorder ever attached. ``recorded``: a
Recorder(every=2) made first, then the same compile. ``eager``: the Recorder on the
uncompiled model. Each mode runs in its own process so compile caches stay apart.

Kernels are deterministic (``torch.use_deterministic_algorithms(True)``, set before compiling)
and the thread count is the caller's: with two or more threads Inductor's CPU embedding
backward otherwise adds into the gradient with atomics, so two compiled runs *without* a
recorder already differ by ~1e-4 after a few Adam steps (issue 23, item 7). The batch is 8×32
tokens of a small vocabulary, so that threads share embedding rows and the race would show.
QUANTITIES: the Recorder's preset (default ``default``; ``signals`` adds attention
logits and entropy, output log Z, sub-layer RMS and gradient RMS over ε)."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import gradscope
from zoo_cases import batch, tiny

STEPS = 5


def build(name: str):
    torch.manual_seed(0)
    if name == "llama":
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
        model = transformers.LlamaForCausalLM(cfg)

        def data(step):
            ids = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(step))
            return (ids,), ids

        def loss_fn(out, target):
            logits = out.logits
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), target[:, 1:].flatten())

        return model, data, loss_fn
    model = gradscope.build_model(tiny(name, "decoder"))

    def data(step):
        inputs = batch(model.config, seed=step, B=8, S=32)
        return inputs, inputs[-1]

    def loss_fn(out, target):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    return model, data, loss_fn


def main(name: str, mode: str, out: str, quantities: str = "default") -> None:
    torch.use_deterministic_algorithms(True)  # before compiling: Inductor's cache key includes it
    model, data, loss_fn = build(name)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = gradscope.Recorder(model, every=2, quantities=quantities, optimizer=opt) if mode in ("recorded", "eager") else None
    run = model if mode == "eager" else torch.compile(model, fullgraph=True)
    graphs_after_warmup = None
    for step in range(STEPS):
        inputs, target = data(step)
        if rec is None:
            loss_fn(run(*inputs), target).backward()
        else:
            with rec.step(step):
                loss = loss_fn(run(*inputs), target)
                loss.backward()
                rec.log("loss", loss)
        opt.step()
        opt.zero_grad()
        if step == 1:
            graphs_after_warmup = counters["stats"]["unique_graphs"]
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{out}/params.pt")
    if rec is not None:
        rec.save(f"{out}/table.parquet")
        rec.close()
    stats = {"graph_breaks": sum(counters["graph_break"].values()), "unique_graphs": counters["stats"]["unique_graphs"],
             "graphs_after_warmup": graphs_after_warmup, "threads": torch.get_num_threads()}
    with open(f"{out}/stats.json", "w") as f:
        json.dump(stats, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
