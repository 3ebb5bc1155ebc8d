"""Long-run memory soak: train with every quantity recorded and watch the process RSS.

    python -m benchmarks.soak --steps 2000

Prints RSS every ``--report-every`` steps and the growth per 1,000 steps after warm-up, next
to what the stored table itself accounts for (rows × ~20 bytes). Flat memory means the
growth is the table and nothing else (no graph, hook or tensor kept from step to step).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.nn.functional as F

import gradscope


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux /proc)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="training steps, all recorded (default: 2000)")
    parser.add_argument("--report-every", type=int, default=250, help="print RSS every N steps (default: 250)")
    parser.add_argument("--variant", default="dlcl_pre", help="zoo variant (default: dlcl_pre, which records every quantity kind)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = gradscope.presets.tiny(variant=args.variant, n_enc=4, n_dec=4, vocab=64, dropout=0.1)
    model = gradscope.build_model(config)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    rec = gradscope.Recorder(model, quantities="all", optimizer=opt, slow_every=10, run="soak")
    g = torch.Generator().manual_seed(0)
    print(f"soak: {args.variant} 4L-4L d={config.d_model}, every step recorded with quantities='all' (cosine, update_ratio every 10)")
    print("| step | RSS MiB | table rows |\n|---|---|---|")
    samples, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        src = torch.randint(3, 64, (16, 12), generator=g)
        tgt = torch.randint(3, 64, (16, 12), generator=g)
        with rec.step(step):
            logits = model(src, tgt[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten(), label_smoothing=0.1)
            loss.backward()
            rec.log("loss", loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.report_every == 0:
            gc.collect()
            rows = rec.rows_in_memory
            samples.append((step, rss_mb(), rows))
            print(f"| {step} | {samples[-1][1]:.1f} | {rows} |", flush=True)
    rec.close()
    (s0, m0, r0), (s1, m1, r1) = samples[0], samples[-1]
    per_k = (m1 - m0) / (s1 - s0) * 1000
    table_per_k = (r1 - r0) * 20 / 2**20 / (s1 - s0) * 1000
    print(f"\nRSS growth after step {s0}: {m1 - m0:+.1f} MiB over {s1 - s0} steps = {per_k:+.2f} MiB per 1,000 steps; "
          f"the stored table accounts for ≈{table_per_k:.2f} MiB per 1,000 steps ({(r1 - r0) / (s1 - s0):.0f} rows/step × ~20 B). "
          f"Wall time {time.perf_counter() - t0:.0f} s.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
