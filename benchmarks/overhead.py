"""Recorder overhead: step-time ratios to a plain training step, measured side by side.

Every method gets its own copy of the same model and optimizer. For each repeat, one plain
step and one step of the method run back to back, the order alternating between repeats;
the reported number is the median over repeats of the per-pair ratio (method / plain), so
slow drifts of a shared machine cancel. Run it on a quiet machine and say so.

    python -m benchmarks.overhead                      # 6+6, 12+12 and 24+24 layers, d=256
    python -m benchmarks.overhead --depths 12 --repeats 30 --device cuda
    python -m benchmarks.overhead --depths 12 --breakdown --only gradscope   # cost per quantity

Methods: gradscope with default quantities (norms), gradscope with all quantities (cosine
and update ratio every 10 steps), bare hooks taking one norm per site value and gradient with
no bookkeeping (the floor for activation norms), a naive loop calling ``p.grad.norm().item()`` per
parameter, ``wandb.watch(model, log="gradients", log_freq=1)`` offline, and Lightning's
``grad_norm`` utility (the last two only when installed: ``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import gradscope


def make_model(total_layers: int, d_model: int, device: str) -> torch.nn.Module:
    """A Pre-LN encoder–decoder with total_layers/2 layers per stack (the reference: 12 = 6+6)."""
    torch.manual_seed(0)
    config = gradscope.ModelConfig(variant="pre_ln", n_enc=total_layers // 2, n_dec=total_layers // 2, d_model=d_model,
                                   n_heads=4, d_ff=4 * d_model, vocab=1000, dropout=0.1, max_len=64)
    return gradscope.build_model(config).to(device)


def make_batch(batch_size: int, length: int, device: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(3, 1000, (batch_size, length), generator=g)
    tgt = torch.randint(3, 1000, (batch_size, length + 1), generator=g)
    return src.to(device), tgt[:, :-1].to(device), tgt[:, 1:].to(device)


def loss_of(model, batch) -> torch.Tensor:
    src, tgt_in, tgt_out = batch
    logits = model(src, tgt_in)
    return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), label_smoothing=0.1)


def plain(model, opt, batch) -> Callable[[int], None]:
    def step(i):
        loss_of(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def with_recorder(quantities: str | list[str]) -> Callable:
    def setup(model, opt, batch):
        rec = gradscope.Recorder(model, quantities=quantities, optimizer=opt, slow_every=10)

        def step(i):
            with rec.step(i):
                loss = loss_of(model, batch)
                loss.backward()
                rec.log("loss", loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    return setup


def naive_item(model, opt, batch):
    def step(i):
        loss_of(model, batch).backward()
        _ = {n: p.grad.norm().item() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def bare_site_norms(model, opt, batch):
    """The floor: a forward hook per distinct site value and a tensor hook per gradient, each
    taking one ``vector_norm`` into a list, with no bookkeeping at all (what any recorder of
    these quantities has to do)."""
    sites = [m for m in model.modules() if isinstance(m, gradscope.Site)]

    def step(i):
        out: list[torch.Tensor] = []
        seen: set[int] = set()

        def on_value(module, args, value):
            if id(value) not in seen:
                seen.add(id(value))
                out.append(torch.linalg.vector_norm(value.detach()))
                value.register_hook(lambda g: out.append(torch.linalg.vector_norm(g)))

        handles = [m.register_forward_hook(on_value) for m in sites]
        loss_of(model, batch).backward()
        for h in handles:
            h.remove()
        torch.stack(out).tolist()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


RUNS: list = []  # open wandb runs, finished after their method is measured


def wandb_watch(model, opt, batch):
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(mode="offline", dir=tempfile.mkdtemp(prefix="gradscope-wandb-"), project="gradscope-bench")
    run.watch(model, log="gradients", log_freq=1)
    RUNS.append(run)

    def step(i):
        loss = loss_of(model, batch)
        loss.backward()
        run.log({"loss": loss.item()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def lightning_grad_norm(model, opt, batch):
    from lightning.pytorch.utilities import grad_norm

    def step(i):
        loss_of(model, batch).backward()
        _ = {k: float(v) for k, v in grad_norm(model, norm_type=2).items()}  # what self.log_dict would read
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


METHODS: dict[str, Callable] = {
    "gradscope norms (default)": with_recorder("default"),
    "gradscope all (cosine every 10)": with_recorder("all"),
    "bare hooks: one vector_norm per site value and gradient": bare_site_norms,
    "naive p.grad.norm().item() loop": naive_item,
    "wandb.watch(log='gradients', log_freq=1) offline": wandb_watch,
    "lightning grad_norm": lightning_grad_norm,
}


BREAKDOWN = ("act_grad_norm", "act_norm", "param_grad_norm", "ln_gain", "ln_w_over_sigma", "nonfinite")


def timed(step: Callable[[int], None], i: int, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(i)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(total_layers: int, args) -> dict[str, tuple[float, float, float] | str]:
    """Method name → (median ratio, 25th, 75th percentile of per-pair ratios), or why not measured."""
    base = make_model(total_layers, args.d_model, args.device)
    batch = make_batch(args.batch_size, args.length, args.device)
    results = {}
    for name, setup in METHODS.items():
        if args.only and not any(o in name for o in args.only):
            continue
        ref_model, model = copy.deepcopy(base), copy.deepcopy(base)
        betas = (0.9, 0.98)
        ref_step = plain(ref_model, torch.optim.Adam(ref_model.parameters(), 1e-4, betas=betas), batch)
        try:
            step = setup(model, torch.optim.Adam(model.parameters(), 1e-4, betas=betas), batch)
        except ImportError as err:
            results[name] = f"not installed ({err.name})"
            continue
        for i in range(args.warmup):
            ref_step(i)
            step(i)
        ratios = []
        for r in range(args.repeats):
            i = args.warmup + r
            if r % 2:
                t_ref = timed(ref_step, i, args.device)
                t = timed(step, i, args.device)
            else:
                t = timed(step, i, args.device)
                t_ref = timed(ref_step, i, args.device)
            ratios.append(t / t_ref)
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        results[name] = (statistics.median(ratios), q[0], q[2])
        while RUNS:
            RUNS.pop().finish()
    return results


def machine() -> str:
    """One line describing where this ran."""
    cpu = platform.processor() or platform.machine()
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{dev}; {cpu}; Python {platform.python_version()}; torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[12, 24, 48], help="total layers (encoder + decoder), split evenly (default: 12 24 48)")
    parser.add_argument("--d-model", type=int, default=256, help="model width (default: 256)")
    parser.add_argument("--batch-size", type=int, default=16, help="sentences per batch (default: 16)")
    parser.add_argument("--length", type=int, default=32, help="tokens per sentence (default: 32)")
    parser.add_argument("--repeats", type=int, default=20, help="timed pairs per method (default: 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu", help="where to run (default: cuda if available)")
    parser.add_argument("--only", nargs="*", default=None, help="substrings of method names to run (default: all)")
    parser.add_argument("--breakdown", action="store_true", help="also time gradscope with one quantity at a time (where the cost is)")
    args = parser.parse_args(argv)
    if args.breakdown:
        for quantity in BREAKDOWN:
            METHODS[f"gradscope {quantity} only"] = with_recorder([quantity])
    print(f"machine: {machine()}")
    print(f"command: python -m benchmarks.overhead {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"model: pre_ln encoder-decoder, d={args.d_model}, batch {args.batch_size}x{args.length} tokens, Adam; {args.repeats} pairs after {args.warmup} warm-up steps\n")
    print("| method | " + " | ".join(f"{d} layers" for d in args.depths) + " |")
    print("|---|" + "---|" * len(args.depths))
    table: dict[str, list[str]] = {}
    for depth in args.depths:
        for name, value in measure(depth, args).items():
            cell = value if isinstance(value, str) else f"{value[0]:.3f}× ({value[1]:.3f}–{value[2]:.3f})"
            table.setdefault(name, []).append(cell)
    for name, cells in table.items():
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nCells: median of per-pair step-time ratios to a plain step (interquartile range).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
