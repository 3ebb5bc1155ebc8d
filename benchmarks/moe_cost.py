"""What the ``moe`` quantities cost on a recorded step (docs/moe.md; benchmarks/RESULTS.md).

An HF Mixtral built from its config (random weights), trained with Adam on random tokens;
each method's step time is compared with a plain step of the same model in
order-alternating pairs, after warm-up steps, and the median ratio (and interquartile
range) over the pairs is printed. Methods: the default quantities, default plus the
routing quantities (what ``"all"`` adds on an MoE model), and the ``"moe"`` set (routing
plus per-expert norms).

    python -m benchmarks.moe_cost --pairs 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers as tf

import gradscope
from gradscope.recorder.quantities.registry import DEFAULT_QUANTITIES, ROUTING_QUANTITIES

METHODS = {"default": DEFAULT_QUANTITIES, "default + routing": DEFAULT_QUANTITIES + ROUTING_QUANTITIES, "moe": "moe"}


def build(d: int, layers: int, experts: int, impl: str) -> torch.nn.Module:
    cfg = tf.MixtralConfig(vocab_size=512, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=2,
                           max_position_embeddings=256)
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    return tf.MixtralForCausalLM(cfg)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=128, help="model width")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers, each an MoE layer")
    ap.add_argument("--experts", type=int, default=8, help="routed experts per layer (top-2)")
    ap.add_argument("--batch", type=int, nargs=2, default=(8, 64), help="sequences and tokens per sequence")
    ap.add_argument("--pairs", type=int, default=10, help="order-alternating (plain, recorded) pairs per method")
    ap.add_argument("--warmup", type=int, default=3, help="steps before timing")
    ap.add_argument("--impl", default="eager", help="transformers' experts implementation (eager, batched_mm)")
    ap.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the model (needs --impl batched_mm)")
    args = ap.parse_args(argv)
    model = build(args.d, args.layers, args.experts, args.impl)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randint(0, 512, tuple(args.batch), generator=torch.Generator().manual_seed(1))
    call = torch.compile(model, fullgraph=True) if args.compile else model

    def step(rec, s):
        if rec is None:
            loss = call(x, labels=x).loss
            loss.backward()
        else:
            with rec.step(s):
                loss = call(x, labels=x).loss
                loss.backward()
        opt.step()
        opt.zero_grad()

    print(f"Mixtral d={args.d} layers={args.layers} experts={args.experts} top-2, batch {args.batch[0]}x{args.batch[1]}, "
          f"experts impl {args.impl}, {'compiled' if args.compile else 'eager'}, torch threads {torch.get_num_threads()}")
    plain_ms = []
    for name, quantities in METHODS.items():
        rec = gradscope.Recorder(model, quantities=quantities, optimizer=opt)
        for s in range(args.warmup):
            step(rec, s)
            step(None, s)
        ratios = []
        for i in range(args.pairs):
            times = {}
            for which in ((None, rec) if i % 2 == 0 else (rec, None)):
                t = time.perf_counter()
                step(which, 1000 + i)
                times[which is None] = time.perf_counter() - t
            ratios.append(times[False] / times[True])
            plain_ms.append(times[True] * 1e3)
        rec.close()
        q = statistics.quantiles(ratios, n=4)
        print(f"| {name} | {statistics.median(ratios):.3f}x ({q[0]:.3f}-{q[2]:.3f}) |")
    print(f"plain step: median {statistics.median(plain_ms):.1f} ms")


if __name__ == "__main__":
    main()
