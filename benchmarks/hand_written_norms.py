"""What a hand-written norm costs a recorded step, against the same model with torch's own norm module.

    OMP_NUM_THREADS=1 python -m benchmarks.hand_written_norms --layers 6 --d-model 32 --pairs 100
    OMP_NUM_THREADS=1 python -m benchmarks.hand_written_norms --layers 4 --compile-only

A nanoGPT-style model (written here) is built four times with the same weights: with
nanoGPT's ``LayerNorm`` (``F.layer_norm``, a literal eps), with an RMSNorm written as people
write it, and with their twins, ``nn.LayerNorm`` and ``nn.RMSNorm`` (torch's modules of the
same math, whose form and eps the recorder reads off the module). Eager: plain and recorded
steps of each are interleaved, the order rotated, and the median of per-pair times is printed
with the recorded step's ratio to its twin's recorded step, and what recording adds to a plain
step against what it adds to the twin's (``nn.LayerNorm``'s plain step is one fused kernel, so
a hand-written RMSNorm is also shown against it). Compiled
(``fullgraph=True``): each model is compiled in a process of its own with a fresh Inductor
cache, and the wall time of its first recorded and first unrecorded step is printed. The
issue's target (issue 50): recorded-step cost and compile time within 10 % of the twin's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import gradscope

V, T, B = 64, 16, 4


class NanoLayerNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class HandRMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * self.weight


def TorchRMSNorm(d: int) -> nn.RMSNorm:  # noqa: N802 (a norm class's stand-in)
    return nn.RMSNorm(d, eps=1e-6)


NORMS = {"nanoGPT LayerNorm": NanoLayerNorm, "hand-written RMSNorm": HandRMSNorm, "nn.LayerNorm (twin)": nn.LayerNorm,
         "nn.RMSNorm (twin)": TorchRMSNorm}
LN_TWIN, RMS_TWIN = "nn.LayerNorm (twin)", "nn.RMSNorm (twin)"
TWIN = {"nanoGPT LayerNorm": LN_TWIN, "hand-written RMSNorm": RMS_TWIN, LN_TWIN: LN_TWIN, RMS_TWIN: RMS_TWIN}


class Block(nn.Module):
    def __init__(self, d: int, norm):
        super().__init__()
        self.ln_1, self.qkv, self.proj = norm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln_2, self.fc, self.out = norm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(self.ln_1(x)).split(x.shape[-1], dim=2)
        y = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal=True).squeeze(1)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, norm, layers: int, d: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(T, d)
        self.h = nn.ModuleList([Block(d, norm) for _ in range(layers)])
        self.ln_f, self.head = norm(d), nn.Linear(d, V, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x)).view(-1, V), idx.view(-1))


def _models(layers: int, d: int) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    first = GPT(NanoLayerNorm, layers, d)
    out = {}
    for name, norm in NORMS.items():
        torch.manual_seed(0)
        model = GPT(norm, layers, d)
        model.load_state_dict(first.state_dict(), strict=False)  # (the RMSNorm has no bias)
        out[name] = model
    return out


def eager(layers: int, d: int, pairs: int) -> None:
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    models = _models(layers, d)
    plain = _models(layers, d)  # copies of their own, no recorder ever attached
    recs = {n: gradscope.Recorder(m) for n, m in models.items()}
    times = {(n, kind): [] for n in NORMS for kind in ("plain", "recorded")}

    def one(name: str, kind: str, step: int) -> float:
        model = models[name] if kind == "recorded" else plain[name]
        t0 = time.perf_counter()
        if kind == "recorded":
            with recs[name].step(step):
                model(idx).backward()
        else:
            model(idx).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    order = [(n, k) for n in NORMS for k in ("plain", "recorded")]
    for step in range(3 + pairs):
        for name, kind in order[step % len(order):] + order[:step % len(order)]:  # rotated each round
            t = one(name, kind, step)
            if step >= 3:
                times[name, kind].append(t)
    med = {key: sorted(v)[len(v) // 2] * 1e3 for key, v in times.items()}
    print(f"eager, {layers} layers, d={d}, batch {B}x{T}, {pairs} rounds, {torch.get_num_threads()} thread(s)")
    print("| norm | plain step | recorded step | recorded / plain | recorded / its twin's recorded | "
          "added by recording / its twin's | recorded / nn.LayerNorm's recorded |")
    print("|---|---|---|---|---|---|---|")
    for name in NORMS:  # (the "added" column leaves out what the norm's own form costs a plain step)
        p, r = med[name, "plain"], med[name, "recorded"]
        twin, twin_plain = med[TWIN[name], "recorded"], med[TWIN[name], "plain"]
        print(f"| {name} | {p:.2f} ms | {r:.2f} ms | {r / p:.3f}x | {r / twin:.3f}x | {(r - p) / (twin - twin_plain):.3f}x "
              f"| {r / med[LN_TWIN, 'recorded']:.3f}x |")
    for rec in recs.values():
        rec.close()


def compile_one(name: str, layers: int, d: int) -> None:
    """In a fresh process: compile and run one recorded and one unrecorded step; print seconds."""
    model = _models(layers, d)[name]
    rec = gradscope.Recorder(model, every=2)
    run = torch.compile(model, fullgraph=True)
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    for step in range(2):  # step 0 recorded, step 1 not: both graphs compile
        with rec.step(step):
            run(idx).backward()
    rows = len(rec.frame())
    rec.close()
    print(f"{time.perf_counter() - t0:.1f} {rows}")


def compiled(layers: int, d: int) -> None:
    print(f"compiled (fullgraph), {layers} layers, d={d}: wall time of the first recorded and unrecorded step, "
          "each model in a process of its own with a fresh Inductor cache")
    print("| norm | compile + 2 steps | recorded rows | / its twin's |")
    print("|---|---|---|---|")
    results = {}
    for name in NORMS:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
            out = subprocess.run([sys.executable, "-m", "benchmarks.hand_written_norms", "--compile-one", name,
                                  "--layers", str(layers), "--d-model", str(d)], env=env, capture_output=True, text=True,
                                 check=True)
            seconds, rows = out.stdout.split()[-2:]
            results[name] = (float(seconds), int(rows))
    for name, (seconds, rows) in results.items():
        print(f"| {name} | {seconds:.1f} s | {rows} | {seconds / results[TWIN[name]][0]:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hand_written_norms", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6, help="blocks (default: 6)")
    parser.add_argument("--d-model", type=int, default=32, help="width (default: 32)")
    parser.add_argument("--pairs", type=int, default=100, help="timed rounds of every step kind (default: 100)")
    parser.add_argument("--compile-only", action="store_true", help="only the compile times")
    parser.add_argument("--eager-only", action="store_true", help="only the eager step times")
    parser.add_argument("--compile-one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_one:
        compile_one(args.compile_one, args.layers, args.d_model)
        return 0
    if not args.compile_only:
        eager(args.layers, args.d_model, args.pairs)
    if not args.eager_only:
        compiled(args.layers, args.d_model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
