"""Nguyen & Salazar 2019: training without warm-up at a large learning rate; ScaleNorm g vs depth.

post_ln, pre_ln and scalenorm encoder-decoders at the shallow setting (6L-6L, the
paper's base regime; 2L-2L at ci) are trained on the ``reverse`` task with no warm-up:
the peak learning rate 2e-3 — twice the 1e-3 of the other analyses, and Wang 2019's
deep-model rate — is held constant from step 1. As in Nguyen & Salazar's own configuration,
every model starts from SmallInit (§4.1: attention N(0, 2/(5d)), FFN N(0, 2/(d+d_ff))) and
ScaleNorm comes with FixNorm (§2.3: unit-length word embeddings), its proposal's other half.
Everything else is the shared recipe, on 3 seeds at every preset (9 cheap 6L runs).
The ScaleNorm model's learned g (init √d) is recorded per norm at init and during
training.

Claim: without warm-up, PreNorm and ScaleNorm train, PostNorm does not (or ends with a
higher loss).

    python -m analyses.warmup_free --preset default --out figures
"""

from __future__ import annotations

import math
import sys

import matplotlib.pyplot as plt
import pandas as pd

from analyses.outputs import tag
from analyses.runner import Analysis, entry_point
from analyses.runs import RunSpec
from gradscope import claims, plots
from gradscope.train import loss_bounds

VARIANTS = ("post_ln", "pre_ln", "scalenorm")
LR = 2e-3
STEPS = {"ci": 100, "default": 300, "paper": 50_000}
INIT = "small"  # Nguyen & Salazar 2019 §4.1 SmallInit, for every variant (the same hyper-parameters)


def options(variant: str) -> dict:
    """The model options of ``variant`` in Nguyen & Salazar's configuration: FixNorm with ScaleNorm."""
    return {"init": INIT, **({"fixnorm": True} if variant == "scalenorm" else {})}


class WarmupFree(Analysis):
    """The three variants at the shallow setting, ``STEPS`` steps at a constant ``LR``, no warm-up."""

    name = "warmup_free"
    quantities = ("scalenorm_g",)
    recordings = 4
    min_train_seeds = 3

    @property
    def depth(self) -> int:
        return self.preset.shallow

    def plan(self) -> list[RunSpec]:
        n, p = self.depth, self.preset
        return [self.trained(v, p.model(v, n, n, **options(v)), STEPS[p.name], k=k, lr=LR, warmup=0,
                             schedule="constant")
                for k in self.seed_indices(trained=True) for v in VARIANTS]

    def quantities_for(self, spec: RunSpec) -> tuple[str, ...]:
        """g only exists in the ScaleNorm model."""
        return self.quantities if spec.model.variant == "scalenorm" else ()

    def conclude(self, df: pd.DataFrame) -> list[claims.Verdict]:
        bounds = loss_bounds(self.task(self.seed), self.preset.train(1).label_smoothing)
        v = claims.over_seeds(claims.nguyen_warmup_free, df, bounds=bounds, preset=self.preset.name)
        return [tag(v, f"{self.depth}L-{self.depth}L, constant lr {LR:g}")]

    def draw(self, df: pd.DataFrame, verdicts) -> plt.Figure:
        fig, axes = plt.subplots(2, 2, figsize=(15, 10), layout="constrained")
        df = self.first_seed(df)
        setting = f"{self.depth}L-{self.depth}L, no warm-up, lr {LR:g} · preset {self.preset.name}"
        for ax, quantity in zip(axes[0], ("loss", "val_loss")):
            plots.loss_curves(df, quantity=quantity, hue_order=VARIANTS, ax=ax, title=f"Nguyen & Salazar: {setting}")
        for ax, stack in zip(axes[1], ("encoder", "decoder")):
            plots.scalenorm_g(df, stack=stack, init_g=math.sqrt(self.preset.size.d_model), ax=ax,
                              title=f"ScaleNorm g by {stack} layer after training, {setting}")
        low, high = min(a.get_ylim()[0] for a in axes[1]), max(a.get_ylim()[1] for a in axes[1])
        for ax in axes[1]:  # (one scale for both stacks, which a stretched axis of each made look alike)
            ax.set_ylim(low, high)
        recipe = self.plan()[0].train.describe().replace("constant schedule", "constant lr")
        return self.annotate(fig, "Warm-up-free training at a large learning rate; learned ScaleNorm g",
                             [recipe, "same hyper-parameters for every variant; SmallInit (§4.1), FixNorm with ScaleNorm (§2.3)"], verdicts)


ANALYSIS = WarmupFree
main = entry_point(__doc__, WarmupFree)

if __name__ == "__main__":
    sys.exit(main())
