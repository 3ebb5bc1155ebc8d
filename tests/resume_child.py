"""Child process for the resume test: trains a tiny decoder LM streaming to ``OUT/run`` with
``flush_every=2`` and checkpoints after step ``CKPT``; with ``--resume`` it starts from that
checkpoint into the same ``log_dir``, on other batches, and saves
what it recorded itself to ``OUT/resumed.parquet``. Prints ``step N`` as each step starts.

    python tests/resume_child.py OUT STEPS CKPT [--resume]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import gradscope


def main(out: str, steps: int, ckpt_step: int, resume: bool) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gradscope.build_model(gradscope.presets.tiny(variant="pre_ln", arch="decoder"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ckpt = f"{out}/ckpt.pt"
    start = 0
    if resume:
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
    rec = gradscope.Recorder(model, optimizer=opt, log_dir=f"{out}/run", flush_every=2)
    for step in range(start, steps):
        print(f"step {step}", flush=True)
        tokens = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(step + 1000 * resume))  # other batches
        with rec.step(step):
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            rec.log("loss", loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == ckpt_step and not resume:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    rec.close()
    if resume:  # what this process itself recorded
        gradscope.save_frame(rec.frame(), f"{out}/resumed.parquet")
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), "--resume" in sys.argv[4:])
