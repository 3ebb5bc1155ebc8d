"""Child process for the interruption test: trains a tiny zoo model with the recorder and
checkpoints; prints 'step N' as each step starts so the parent can kill it mid-run.

    python tests/interrupt_child.py OUT_DIR STEPS
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import gradscope
from gradscope.train import TrainConfig, make_task, train


class LoudRecorder(gradscope.Recorder):
    def begin_step(self, step, **kwargs):
        print(f"step {step}", flush=True)
        return super().begin_step(step, **kwargs)


def main(out: str, steps: int) -> None:
    torch.set_num_threads(1)
    out_dir = Path(out)
    task = make_task("reverse", vocab=24, max_len=10, seed=0)
    torch.manual_seed(0)
    model = gradscope.build_model(gradscope.presets.tiny(variant="pre_ln", vocab=24, dropout=0.1, max_len=16))
    rec = LoudRecorder(model, quantities="all", slow_every=3, run="interrupt")
    config = TrainConfig(steps=steps, batch_size=8, lr=1e-3, warmup=4, eval_every=5, eval_batches=1,
                         checkpoint_every=4, seed=0, device="cpu")
    result = train(model, task, config, recorder=rec, checkpoint_dir=out_dir / "ckpt", progress=False, run="interrupt")
    rec.close()
    torch.save(model.state_dict(), out_dir / "params.pt")
    rec.save(out_dir / "record.parquet")
    gradscope.save_frame(result.history, out_dir / "history.parquet")
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
