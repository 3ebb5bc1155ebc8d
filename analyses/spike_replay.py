"""Spike replay (issue 26): the watch flags a planted spike, and the replay records that very step.

A Pre-LN decoder LM (the preset's width, its shallow depth: 6 layers at default, 2 at ci)
trains on the built-in ``markov_lm`` task with the preset's recipe and gradient clipping at
1.0 (clipped with the watch's own norm, ``clip_grads_with_norm_(..., rec.grad_norm)``). At
step ``PLANTED`` the loss is multiplied by 1e3 before backward. Two runs of the same seed,
weights and batches:

- ``watched``: ``Recorder(every=EVERY, on_spike="replay")`` with ``rec.run``: every step is
  watched (loss and total gradient norm, the ``spike`` rule with a 16-step history), and a
  flagged step the schedule skips is replayed and recorded with every quantity;
- ``always``: a Recorder that records every step (the reference).

Claims, with rules fixed in ``gradscope/claims/replay.py`` before any run: the planted step
is flagged; no other step is; the replayed rows equal the ``always`` run's at that step to
1e-6. Both runs record every quantity of ``all`` but ``spike`` (a window over the earlier
*recorded* steps, which differ between the runs by design), with cosine taken over every
token (a sampled cosine draws from the recorder's own generator, whose state depends on the
steps recorded before). The figure: the watch's series, the per-layer gradient norms at the layer outputs of
the replayed step and of the steps recorded before and after it, and their ratio.

    python -m analyses.spike_replay --preset default --out figures
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch

import gradscope
from analyses.runner import Analysis, entry_point
from analyses.runs import Bench, RunSpec
from gradscope import RecorderOptions, claims, plots
from gradscope.recorder import ALL_QUANTITIES
from gradscope.train import label_smoothed_loss
from gradscope.train.optim import make_optimizer, make_scheduler
from gradscope.train.tasks import make_task

STEPS = {"ci": 40, "default": 200, "paper": 50_000}
PLANTED = {"ci": 33, "default": 163, "paper": 40_037}
EVERY = {"ci": 10, "default": 25, "paper": 1_000}
FACTOR = 1e3
CLIP = 1.0
QUANTITIES = tuple(q for q in ALL_QUANTITIES if q != "spike")  # spike rows: a window over earlier *recorded* steps
COSINE_TOKENS = 4096  # every token of a batch: no sampling with the recorder's generator, whose state differs
TASK = "markov_lm"
RUNS = ("watched", "always")


class SpikeReplay(Analysis):
    """Two runs (``RUNS``) of one Pre-LN decoder with a spike planted at ``PLANTED``."""

    name = "spike_replay"
    task_name = TASK
    runs_apart = False  # (collect keeps the watch's readings on the analysis)

    @property
    def depth(self) -> int:
        return self.preset.shallow

    @property
    def planted(self) -> int:
        return min(PLANTED[self.preset.name], self.plan()[0].train.steps)

    def plan(self) -> list[RunSpec]:
        model = self.preset.decoder("pre_ln", self.depth)
        spec = self.trained("watched", model, STEPS[self.preset.name])
        return [spec, RunSpec("always", model, spec.train)]

    def task(self, seed: int):
        return make_task(TASK, vocab=self.preset.size.vocab, max_len=self.preset.size.max_len, seed=seed)

    def collect(self, spec: RunSpec, bench: Bench) -> list[pd.DataFrame]:
        torch.manual_seed(bench.seed)
        model = gradscope.build_model(spec.model).to(bench.device)
        config, task = spec.train, bench.task
        opt = make_optimizer(model, config)
        sched = make_scheduler(opt, config)
        every = EVERY[self.preset.name] if spec.run == "watched" else 1
        with warnings.catch_warnings():  # ('all' spelt out: its MoE and ScaleNorm quantities have nothing here, as expected)
            warnings.filterwarnings("ignore", message=".*has nothing to measure in this model")
            rec = gradscope.Recorder(model, optimizer=opt, quantities=list(QUANTITIES), every=every, slow_every=1,
                                     run=spec.run, on_spike="replay",
                                     options=RecorderOptions(cosine_tokens=COSINE_TOKENS))
        readings = []
        model.train()
        torch.manual_seed(bench.seed)  # dropout
        try:
            for step in range(1, config.steps + 1):
                batch = tuple(t.to(bench.device) for t in task.batch("train", step, config.batch_size))

                def forward_backward(batch=batch, step=step) -> torch.Tensor:
                    logits = model(*task.model_inputs(batch))  # (B, T, vocab)
                    loss = label_smoothed_loss(logits, task.targets(batch), pad_id=task.pad_id,
                                               smoothing=config.label_smoothing)
                    loss = loss * FACTOR if step == self.planted else loss  # the planted spike
                    loss.backward()
                    return loss

                rec.run(step, forward_backward)
                torch.nn.utils.clip_grads_with_norm_(model.parameters(), CLIP, rec.grad_norm)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                r = rec.watch.last
                readings.append({"run": spec.run, "step": step, "loss": r.loss, "grad_norm": r.grad_norm,
                                 "z": r.z, "flagged": r.flagged})
        finally:
            rec.close()
        self._watch = pd.concat([getattr(self, "_watch", pd.DataFrame()), pd.DataFrame(readings)], ignore_index=True)
        return [rec.frame()]

    def watch(self) -> pd.DataFrame:
        """The watched run's readings, one row per step."""
        return self._watch[self._watch.run == "watched"].reset_index(drop=True)

    def conclude(self, df: pd.DataFrame) -> list[claims.Verdict]:
        p, watch = self.preset.name, self.watch()
        checks = [claims.replay_flags_planted_step(watch, self.planted, preset=p),
                  claims.replay_flags_nothing_else(watch, self.planted, preset=p),
                  claims.replay_rows_equal_recorded(df, self.planted, watched="watched", always="always", preset=p)]
        return [dataclasses.replace(v, kind=claims.CONTROL) for v in checks]  # checks of the tool, not of a paper

    def extra_tables(self, df: pd.DataFrame) -> dict[str, pd.DataFrame]:
        return {"spike_replay_watch": self._watch}

    def restore(self, out: Path) -> None:
        path = out / "spike_replay_watch.parquet"
        if not path.exists():
            raise SystemExit(f"spike_replay: --redraw needs {path} (the watch's readings) beside the table")
        self._watch = pd.read_parquet(path)

    def neighbours(self) -> tuple[int, int]:
        """The steps the watched run's schedule recorded just before and after the planted one."""
        every = EVERY[self.preset.name]
        before = self.planted // every * every
        return before, min(before + every, self.plan()[0].train.steps // every * every)

    def draw(self, df: pd.DataFrame, verdicts) -> plt.Figure:
        fig, axes = plt.subplots(1, 3, figsize=(21, 6), layout="constrained")
        setting = f"pre_ln decoder {self.depth}L · preset {self.preset.name}"
        plots.spike_watch(self.watch(), ax=axes[0], title=f"the watch, every step ({setting})")
        watched = df[df.run == "watched"]
        near = [s for s in self.neighbours() if s != self.planted and s in set(watched.step)]
        if self.planted in set(watched.loc[watched.quantity == "act_grad_norm", "step"]):
            plots.replay_profile(watched, step=self.planted, neighbours=near, ax=axes[1],
                                 title=f"per-layer gradient, replayed vs recorded steps ({setting})")
            plots.replay_profile(watched, step=self.planted, neighbours=near, ratio=True, factor=FACTOR, ax=axes[2],
                                 title=f"where the gradient jumped ({setting})")
        else:  # (the watch did not replay the planted step: the verdicts say so)
            for ax in axes[1:]:
                ax.text(0.5, 0.5, f"no replayed rows at step {self.planted}:\nthe watch did not replay it",
                        ha="center", va="center", transform=ax.transAxes)
                ax.set_axis_off()
        train = self.plan()[0].train
        return self.annotate(fig, "Spike replay: the watch flags a planted spike and the replay records that step",
                             [f"{train.describe()}; clip {CLIP:g} with the watch's norm",
                              f"loss x{FACTOR:g} before backward at step {self.planted}; watched run: every="
                              f"{EVERY[self.preset.name]}, on_spike='replay' (window 128, 16-step history, 6 sigma); "
                              "reference run: every step recorded; quantities 'all' but spike (its window holds the earlier "
                              "recorded steps, which differ between the runs), cosine over every token (unsampled)"], verdicts)


ANALYSIS = SpikeReplay
main = entry_point(__doc__, SpikeReplay)

if __name__ == "__main__":
    sys.exit(main())
