"""The papers' figures, one ``python -m analyses.<name>`` each (docs/papers.md).

| module | figure | claims |
|---|---|---|
| ``grad_norms`` | Takase Fig. 3; Wang §4.2 | Post-LN vanishes, Pre-LN decays, B2T mitigates; deep Post-LN's embed grad → 0 in training |
| ``ln_locations`` | Takase 2022 Fig. 4 / 7 | the gradient drops through each LayerNorm |
| ``residual_shrink`` | Xu 2020 Table 2 | Post-LN w/σ < 1; Lipschitz init keeps it nearer 1 |
| ``cosine`` | Takase 2022 Fig. 5 | Pre-LN's lower-left similarities are higher; B2T keeps Post-LN's pattern |
| ``dlcl_weights`` | Wang 2019 Fig. 5 a-c | DLCL W dense early, sparse late, mass near the diagonal |
| ``warmup_free`` | Nguyen & Salazar 2019 | PreNorm / ScaleNorm train without warm-up, PostNorm does not |
| ``convergence`` | Takase 2022 Fig. 1/6/8/9; Xu 2020 Tab. 1/3; Wang 2019 Fig. 3 | deep Post-LN fails; Lipschitz rescues |
| ``lr_sensitivity`` | Wortsman 2023 Fig. 1, §3.1–3.2 | qk_norm lowers LR sensitivity, keeps attention logits down; z-loss where it acts |
| ``spike_replay`` | (issue 26: spike replay) | the watch flags a planted spike, nothing else; the replay equals an always-recording run |
| ``moe_routing`` | (issue 52: MoE routing) | controls: the moe quantities see a router pushed to collapse (imbalance, entropy) |
| ``scan_agreement`` | (validation of ``gradscope scan``) | the step-0 scan verdict vs. learned/failed of each convergence run |

``python -m analyses --preset default --out figures`` runs them all in this order, then the
validations (``scan_agreement``, which reads ``convergence``'s sweep).

Each figure module defines one :class:`analyses.runner.Analysis` (``ANALYSIS``): what it
plans, collects, concludes and draws; :func:`analyses.runner.run` drives them all alike.
Shared code, by concern: :mod:`analyses.cli` (the flags), :mod:`analyses.runs` (building,
recording and training a run), :mod:`analyses.outputs` (tables, figures, CLAIMS.md) and
:mod:`analyses.runner` (the protocol and its driver). Presets: :mod:`gradscope.presets`.
"""

ANALYSES: tuple[str, ...] = (
    "grad_norms", "ln_locations", "residual_shrink", "cosine", "dlcl_weights", "warmup_free", "convergence",
    "lr_sensitivity", "spike_replay", "moe_routing",
)
VALIDATIONS: tuple[str, ...] = ("scan_agreement",)  # run after the figures; they read their outputs
