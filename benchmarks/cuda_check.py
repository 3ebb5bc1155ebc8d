"""The recorder on a CUDA device: values equal autograd, training bit-identical (eager and
compiled), one host transfer per recorded step. For a GPU machine; prints one line per check.

    python -m benchmarks.cuda_check --n-layers 6 --d-model 512
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

import gradscope


def _model(args, seed=0, dropout=0.1):
    torch.manual_seed(seed)
    cfg = gradscope.presets.base(variant=args.variant, arch="decoder", n_dec=args.n_layers, d_model=args.d_model,
                                 n_heads=args.d_model // 64, d_ff=4 * args.d_model, vocab=1000, dropout=dropout,
                                 max_len=args.length)
    return gradscope.build_model(cfg).to(args.device)


def _batch(step, args):
    g = torch.Generator().manual_seed(step)
    return torch.randint(1, 1000, (args.batch_size, args.length), generator=g).to(args.device)


def _loss(out, tokens):
    return F.cross_entropy(out.flatten(0, 1).float(), tokens.flatten())


def _train(args, *, recorder: bool, compiled: bool, steps: int = 5):
    model = _model(args)
    rec = gradscope.Recorder(model, every=2) if recorder else None
    run = torch.compile(model, fullgraph=True) if compiled else model
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    torch.manual_seed(1)
    for step in range(steps):
        tokens = _batch(step, args)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16):
            if rec is None:
                _loss(run(tokens), tokens).backward()
            else:
                with rec.step(step):
                    _loss(run(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
    return model, rec


def check_values(args) -> bool:
    """act_grad_norm at every site output vs autograd on retained views (no dropout)."""
    model = _model(args, dropout=0.0)
    tokens = _batch(0, args)
    with gradscope.record(model, quantities="all", slow_every=1) as rec:
        _loss(model(tokens), tokens).backward()
    df = rec.frame()
    model.zero_grad()
    views, handles = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, gradscope.Site) and name.endswith(".out"):
            def hook(m, a, out, name=name):
                views[name] = out.view_as(out)
                return views[name]
            handles.append(mod.register_forward_hook(hook))
    loss = _loss(model(tokens), tokens)
    grads = torch.autograd.grad(loss, list(views.values()), allow_unused=True)
    for h in handles:
        h.remove()
    got = df[(df.quantity == "act_grad_norm")].set_index("site").value
    worst = 0.0
    for (name, _), g in zip(views.items(), grads):
        if g is not None:
            worst = max(worst, abs(got[name] - g.norm().item()) / g.norm().item())
    ok = worst <= 1e-4
    print(f"values: {len(df)} rows, worst relative error of act_grad_norm vs autograd {worst:.2e} -> {'ok' if ok else 'FAIL'}")
    return ok


def check_bit_identity(args, compiled: bool) -> bool:
    t = time.time()
    plain, _ = _train(args, recorder=False, compiled=compiled)
    if compiled:
        torch._dynamo.reset()
    watched, rec = _train(args, recorder=True, compiled=compiled)
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), watched.parameters()))
    rows = len(rec.frame())
    print(f"bit-identical after 5 Adam steps ({'compiled' if compiled else 'eager'}, bf16={args.bf16}): {same}; "
          f"{rows} rows recorded; {time.time() - t:.0f} s")
    return same and rows > 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="pre_ln", help="zoo variant (decoder-only LM)")
    p.add_argument("--n-layers", type=int, default=6, help="decoder layers")
    p.add_argument("--d-model", type=int, default=512, help="model width")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per batch")
    p.add_argument("--length", type=int, default=128, help="tokens per sequence")
    p.add_argument("--bf16", action="store_true", help="train under bf16 autocast")
    p.add_argument("--device", default="cuda", help="torch device")
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    results = [check_values(args), check_bit_identity(args, compiled=False), check_bit_identity(args, compiled=True)]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
