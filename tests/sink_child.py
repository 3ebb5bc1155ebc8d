"""Child process for the SIGKILL test: trains a tiny decoder LM with the recorder streaming
to ``OUT_DIR/run`` and prints ``step N`` as each recorded step starts, so the parent can
kill it mid-run.

    python tests/sink_child.py OUT_DIR FLUSH_EVERY STEPS
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import gradscope


def main(out: str, flush_every: int, steps: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gradscope.build_model(gradscope.presets.tiny(variant="pre_ln", arch="decoder"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = gradscope.Recorder(model, quantities="all", optimizer=opt, slow_every=3, log_dir=f"{out}/run", flush_every=flush_every)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        print(f"step {step}", flush=True)
        tokens = torch.randint(3, 64, (4, 8), generator=g)
        with rec.step(step):
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        rec.log("loss", loss.item(), step=step)  # after the step, as gradscope.train does
        opt.step()  # update_ratio rows arrive here, after the step's other rows
        opt.zero_grad(set_to_none=True)
    rec.close()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
