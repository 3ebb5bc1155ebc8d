"""Nguyen & Salazar 2019: training without warm-up at a large learning rate; ScaleNorm g vs depth.

post_ln, pre_ln and scalenorm encoder-decoders at the shallow setting (6L-6L, the
paper's base regime; 2L-2L at ci) are trained on the ``reverse`` task with no warm-up:
the peak learning rate 2e-3 — twice the 1e-3 of the other analyses, and Wang 2019's
deep-model rate — is held constant from step 1. Everything else is the shared recipe.
The ScaleNorm model's learned g (init √d) is recorded per norm at init and during
training.

Claim: without warm-up, PreNorm and ScaleNorm train, PostNorm does not (or ends with a
higher loss).

    python -m analyses.warmup_free --preset default --out figures
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd

from analyses import common
from analyses.common import RunSpec
from gradscope import claims, plots

NAME = "warmup_free"
VARIANTS = ("post_ln", "pre_ln", "scalenorm")
LR = 2e-3
QUANTITIES = ("scalenorm_g",)
RECORDINGS = 4
STEPS = {"ci": 100, "default": 200, "paper": 50_000}


@dataclass(frozen=True)
class Settings:
    """What this analysis runs at one preset: ``depth`` layers per stack, ``steps`` steps at ``lr``."""

    preset: common.Preset
    depth: int
    steps: int
    lr: float = LR


def settings(preset: str) -> Settings:
    """The analysis at ``ci``, ``default`` or ``paper``."""
    p = common.PRESETS[preset]
    return Settings(preset=p, depth=p.shallow, steps=STEPS[preset])


def plan(s: Settings, *, seed: int = 0, device: str = "auto", max_steps: int | None = None) -> list[RunSpec]:
    n, p = s.depth, s.preset
    config = p.train(s.steps, seed=seed, device=device, lr=s.lr, warmup=0, schedule="constant")
    return [common.cap_steps(RunSpec(v, p.model(v, n, n), config), max_steps) for v in VARIANTS]


def verdicts(df: pd.DataFrame, s: Settings) -> list[claims.Verdict]:
    v = claims.nguyen_warmup_free(df, preset=s.preset.name)
    return [common.tag(v, f"{s.depth}L-{s.depth}L, constant lr {s.lr:g}")]


def figure(df: pd.DataFrame, s: Settings, specs: list[RunSpec], found: list[claims.Verdict]) -> plt.Figure:
    fig, axes = plt.subplots(2, 2, figsize=(15, 10), layout="constrained")
    setting = f"{s.depth}L-{s.depth}L, no warm-up, lr {s.lr:g} · preset {s.preset.name}"
    for ax, quantity in zip(axes[0], ("loss", "val_loss")):
        plots.loss_curves(df, quantity=quantity, hue_order=VARIANTS, ax=ax, title=f"Nguyen & Salazar: {setting}")
    for ax, stack in zip(axes[1], ("encoder", "decoder")):
        plots.scalenorm_g(df, stack=stack, ax=ax, title=f"ScaleNorm g by {stack} layer after training, {setting}")
        ax.axhline(math.sqrt(s.preset.d_model), color="gray", linestyle="--", linewidth=1, label="init g = √d")
        ax.legend(fontsize="small")
    common.annotate(fig, "Warm-up-free training at a large learning rate; learned ScaleNorm g",
                    [s.preset.describe(), common.recipe_text(specs[0].train).replace("constant schedule",
                                                                                      "constant lr"),
                     "same hyper-parameters for every variant; xavier init"], found)
    return fig


def run(args) -> list[claims.Verdict]:
    s = settings(args.preset)
    specs = plan(s, seed=args.seed, device=args.device, max_steps=args.max_steps)

    def collect(spec, ctx):
        wants = QUANTITIES if spec.model.variant == "scalenorm" else ()
        return [ctx.train(spec, quantities=wants, record_every=max(1, spec.train.steps // RECORDINGS))[1]]

    def conclude(df):
        found = verdicts(df, s)
        return figure(df, s, specs, found), found

    return common.run_analysis(args, NAME, s.preset, specs, collect=collect, conclude=conclude)


main = common.entry_point(NAME, __doc__, run)


if __name__ == "__main__":
    sys.exit(main())
