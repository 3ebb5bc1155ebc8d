"""Takase 2022 Fig. 5: cosine similarities among layer outputs of trained shallow models.

post_ln, pre_ln and b2t encoder-decoders at the shallow setting (6L-6L; 2L-2L at ci) are
trained briefly on the ``reverse`` task with identical hyper-parameters. The trained
models (eval mode, no dropout) then read validation batch 0, and S[i, j] = mean over
sampled non-pad tokens of cos(y_i, y_j), y_0 the embedding output, is recorded for
each stack.

Claims (both stacks): Pre-LN's lower-left similarities (deep outputs vs shallow ones)
exceed Post-LN's; B2T's stay closer to Post-LN's than Pre-LN's do.

    python -m analyses.cosine --preset default --out figures
"""

from __future__ import annotations

import sys

import matplotlib.pyplot as plt
import pandas as pd

from analyses import common
from analyses.common import RunSpec
from gradscope import claims, plots

NAME = "cosine"
VARIANTS = ("post_ln", "pre_ln", "b2t")
STACKS = ("encoder", "decoder")
STEPS = {"ci": 100, "default": 200, "paper": 50_000}


Settings = common.Settings


def settings(preset: str) -> Settings:
    """The analysis at ``ci``, ``default`` or ``paper``."""
    p = common.PRESETS[preset]
    return Settings(preset=p, depth=p.shallow, steps=STEPS[preset])


def plan(s: Settings, *, seed: int = 0, device: str = "auto", max_steps: int | None = None) -> list[RunSpec]:
    n, p = s.depth, s.preset
    return [common.cap_steps(RunSpec(v, p.model(v, n, n), p.train(s.steps, seed=seed, device=device)), max_steps)
            for v in VARIANTS]


def verdicts(df: pd.DataFrame, s: Settings) -> list[claims.Verdict]:
    out = []
    for stack in STACKS:
        for rule in (claims.takase_fig5_pre_ln_higher, claims.takase_fig5_b2t_keeps_post_ln):
            out.append(common.tag(rule(df, stack=stack, preset=s.preset.name), f"{s.depth}L-{s.depth}L trained"))
    return out


def figure(df: pd.DataFrame, s: Settings, specs: list[RunSpec], found: list[claims.Verdict]) -> plt.Figure:
    fig, axes = plt.subplots(2, 4, figsize=(22, 10), layout="constrained")
    for row, stack in enumerate(STACKS):
        for col, variant in enumerate(VARIANTS):
            plots.cosine_heatmap(df, variant=variant, stack=stack, ax=axes[row, col],
                                 title=f"Takase Fig. 5: {variant} {s.depth}L-{s.depth}L · preset {s.preset.name}")
    for ax, quantity in zip(axes[:, 3], ("loss", "val_loss")):
        plots.loss_curves(df, quantity=quantity, hue_order=VARIANTS, ax=ax,
                          title=f"training of the three models · preset {s.preset.name}")
    common.annotate(fig, "Cosine similarities among layer outputs after training (eval mode, validation batch 0)",
                    [s.preset.describe(), common.recipe_text(specs[0].train),
                     "same hyper-parameters for every variant; xavier init"], found)
    return fig


def run(args) -> list[claims.Verdict]:
    s = settings(args.preset)
    specs = plan(s, seed=args.seed, device=args.device, max_steps=args.max_steps)

    def collect(spec, ctx):
        """The training table, and cosine on validation batch 0 after training (eval mode)."""
        model, table, _ = ctx.train(spec)
        return [table, common.measure(model, ctx.task, run=spec.run, quantities=("cosine",), step=spec.train.steps,
                                      split="valid", index=0, batch_size=ctx.batch_size, device=ctx.device,
                                      seed=ctx.seed, eval_mode=True)]

    def conclude(df):
        found = verdicts(df, s)
        return figure(df, s, specs, found), found

    return common.run_analysis(args, NAME, s.preset, specs, collect=collect, conclude=conclude)


main = common.entry_point(NAME, __doc__, run)


if __name__ == "__main__":
    sys.exit(main())
