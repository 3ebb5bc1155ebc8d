"""Wang 2019 Fig. 5 a-c: the learned DLCL layer-combination weights W.

A pre-norm DLCL (``dlcl_pre``, W initialised to ``avg``: W[r, k] = 1/(r+1), learnable)
with a deep encoder and a shallow decoder, as Wang's DLCL-30L (30-layer encoder, 6-layer
decoder; here 18L-6L at default, 6L-2L at ci, 30L-6L at paper), is trained on the
``reverse`` task. W is recorded at initialisation and four times during training.

Figure: W of the encoder and the decoder after training and at initialisation, masked as
in the paper (|w| < 0.1 or < 5% of the row's largest |w|), and one column — the weights of
y_10 (the middle layer at ci) over its consumer rows — at each recorded step.

Claims (both stacks): after masking, early rows are denser than later rows (also checked
at init, where the ``avg`` init alone makes late rows sparse under the absolute mask);
W's mass concentrates near the diagonal.

    python -m analyses.dlcl_weights --preset default --out figures
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd

from analyses import common
from analyses.common import RunSpec
from gradscope import claims, plots

NAME = "dlcl_weights"
VARIANT = "dlcl_pre"
STACKS = ("encoder", "decoder")
QUANTITIES = ("dlcl_weight",)
RECORDINGS = 4  # W is recorded this many times during training, plus at init


@dataclass(frozen=True)
class Settings:
    """What this analysis runs at one preset.

    Attributes:
        preset: shared model size and data.
        n_enc, n_dec: layers of the encoder and decoder.
        column: the layer output whose weights panel (c) follows (the paper's y_10).
        steps: training steps.
    """

    preset: common.Preset
    n_enc: int
    n_dec: int
    column: int
    steps: int


def settings(preset: str) -> Settings:
    """The analysis at ``ci``, ``default`` or ``paper``."""
    p = common.PRESETS[preset]
    n_enc = {"ci": 6, "default": 18, "paper": 30}[preset]
    steps = {"ci": 100, "default": 200, "paper": 50_000}[preset]
    return Settings(preset=p, n_enc=n_enc, n_dec=p.shallow, column=10 if n_enc >= 10 else n_enc // 2, steps=steps)


def plan(s: Settings, *, seed: int = 0, device: str = "auto", max_steps: int | None = None) -> list[RunSpec]:
    p = s.preset
    spec = RunSpec(f"{VARIANT} {s.n_enc}L-{s.n_dec}L", p.model(VARIANT, s.n_enc, s.n_dec),
                   p.train(s.steps, seed=seed, device=device))
    return [common.cap_steps(spec, max_steps)]


def verdicts(df: pd.DataFrame, s: Settings) -> list[claims.Verdict]:
    name, out = s.preset.name, []
    for stack in STACKS:
        out.append(common.tag(claims.wang_fig5_dlcl_dense_early(df, stack=stack, preset=name), "trained"))
        out.append(common.tag(claims.wang_fig5_dlcl_dense_early(df, stack=stack, step="first", preset=name),
                              "at init, avg W"))
        out.append(common.tag(claims.wang_fig5_dlcl_near_diagonal(df, stack=stack, preset=name), "trained"))
    return out


def figure(df: pd.DataFrame, s: Settings, spec: RunSpec, found: list[claims.Verdict]) -> plt.Figure:
    fig, axes = plt.subplots(2, 3, figsize=(20, 12), layout="constrained")
    tag = f"{spec.run} · preset {s.preset.name}"
    for col, (stack, label) in enumerate(zip(STACKS, ("a", "b"))):
        plots.dlcl_heatmap(df, variant=VARIANT, stack=stack, ax=axes[0, col],
                           title=f"Wang Fig. 5{label}: learned {stack} W, {tag}")
        plots.dlcl_heatmap(df, variant=VARIANT, stack=stack, step="first", ax=axes[1, col],
                           title=f"{stack} W at init (avg), {tag}")
    steps = sorted(int(x) for x in df.loc[df["quantity"] == "dlcl_weight", "step"].unique())
    plots.dlcl_column(df, column=s.column, variant=VARIANT, stack="encoder", step=steps, ax=axes[0, 2],
                      title=f"Wang Fig. 5c: encoder weights of y_{s.column} over training, {tag}")
    plots.loss_curves(df, quantity="val_loss", ax=axes[1, 2], title=f"validation loss, {tag}")
    common.annotate(fig, "Learned DLCL weights W[r, k] (row r = input of layer r+1; r = L: stack output)",
                    [s.preset.describe(), common.recipe_text(spec.train),
                     "masking on panels a, b and the init row: |w| < 0.1 or < 5% of the row max |w| "
                     "(Wang 2019), above-diagonal cells not recorded"], found)
    return fig


def run(args) -> list[claims.Verdict]:
    s = settings(args.preset)
    specs = plan(s, seed=args.seed, device=args.device, max_steps=args.max_steps)
    (spec,) = specs

    def conclude(df):
        found = verdicts(df, s)
        return figure(df, s, spec, found), found

    return common.run_analysis(args, NAME, s.preset, specs, conclude=conclude, collect=lambda spec, ctx: [
        ctx.train(spec, quantities=QUANTITIES, record_every=max(1, spec.train.steps // RECORDINGS))[1]])


main = common.entry_point(NAME, __doc__, run)


if __name__ == "__main__":
    sys.exit(main())
