"""Takase 2022 Fig. 4 / 7: gradient norms at locations (1)-(5) inside Post-LN decoder layers.

A Post-LN encoder-decoder at the deep setting (18L-18L at default and paper, 6L-6L at
ci), one forward/backward on training batch 1 of the ``reverse`` task before any update.
In decoder layers 1, L/2 and L, ‖∂L/∂h‖₂ at (1) LN1 input x+SA(x), (2) LN1 output,
(3) LN2 input h1+CA(h1), (4) LN2 output, (5) LN3 input (the last residual sum). The right
panel draws ``ln_gain`` = ‖grad in‖/‖grad out‖ of every decoder norm by layer.

Claim: the norm drops each time backward passes a LayerNorm, (2)→(1) and (4)→(3).

    python -m analyses.ln_locations --preset default --out figures
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.ticker import MaxNLocator

from analyses import common
from analyses.common import RunSpec
from gradscope import claims, plots
from gradscope.plots import select as S

NAME = "ln_locations"
QUANTITIES = ("act_grad_norm", "ln_gain")


@dataclass(frozen=True)
class Settings:
    """What this analysis runs at one preset: the deep Post-LN model (``depth`` per stack)."""

    preset: common.Preset
    depth: int


def settings(preset: str) -> Settings:
    """The analysis at ``ci``, ``default`` or ``paper``."""
    p = common.PRESETS[preset]
    return Settings(preset=p, depth=p.deep)


def plan(s: Settings) -> list[RunSpec]:
    n = s.depth
    return [RunSpec(f"post_ln {n}L-{n}L", s.preset.model("post_ln", n, n))]


def verdicts(df: pd.DataFrame, s: Settings) -> list[claims.Verdict]:
    return [common.tag(claims.takase_fig4_ln_drops(df, preset=s.preset.name), f"{s.depth}L-{s.depth}L")]


def figure(df: pd.DataFrame, s: Settings, found: list[claims.Verdict]) -> plt.Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5), layout="constrained")
    setting = f"post_ln {s.depth}L-{s.depth}L · preset {s.preset.name}"
    plots.location_norms(df, ax=left, title=f"Takase Fig. 4/7: decoder layers {list(S.default_layers(s.depth))}, "
                                            f"{setting}")
    gains = S.rows(df, quantity="ln_gain", stack="decoder")
    gains = gains.loc[gains["layer"].notna()]  # the decoder layers' norms, not its final norm
    part = S.sublayer(gains["site"])  # an ln_gain row's site is its norm's module name
    for label, name in (("self_attn", "LN1 (after SA)"), ("cross_attn", "LN2 (after CA)"), ("ffn", "LN3 (after FFN)")):
        pts = S.one_per_point(gains.loc[part == label]).sort_values("layer")
        right.plot(pts["layer"].to_numpy(float), pts["value"].to_numpy(float), marker="o", markersize=3, label=name)
    right.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="gain = 1")
    right.set_xlabel("decoder layer")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_ylabel("‖∂L/∂x_in‖₂ / ‖∂L/∂x_out‖₂ of the norm (ratio)")
    right.legend(fontsize="small")
    right.set_title(f"backward gain of each decoder LayerNorm, {setting}\nstep 0 · below 1: the norm shrinks "
                    "the gradient", fontsize="medium")
    common.annotate(fig, "Gradient norms inside Post-LN decoder layers at the start of training "
                         "(step 0, one batch, before any update)",
                    [s.preset.describe(), "dropout active (training mode), seeded; xavier init"], found)
    return fig


def run(args) -> list[claims.Verdict]:
    s = settings(args.preset)

    def conclude(df):
        found = verdicts(df, s)
        return figure(df, s, found), found

    return common.run_analysis(args, NAME, s.preset, plan(s), conclude=conclude,
                               collect=lambda spec, ctx: [ctx.train(spec, quantities=QUANTITIES, progress=False)[1]])


main = common.entry_point(NAME, __doc__, run)


if __name__ == "__main__":
    sys.exit(main())
