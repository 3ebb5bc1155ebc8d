"""Decision rules for the claims of docs/papers.md, one function per claim, each returning a
:class:`Verdict`; :func:`write_claims` keeps ``figures/CLAIMS.md``.

Every rule is a fixed formula with named thresholds whose defaults were chosen before
any run (see each function); a claim that the data cannot decide is "inconclusive"
(``holds is None``), never guessed. Functions that compare variants expect one run per
variant in the table they get (filter by run first); several raise ``ValueError``.

Claims (paper / figure: rule with default thresholds; g = act_grad_norm):

- :func:`takase_fig3_post_ln_vanishing` (Takase 2022 Fig. 3b): g(1)/g(L) < 1 over
  decoder layer outputs at the first step.
- :func:`takase_fig3_pre_ln_decay` (Fig. 3): g(L)/g(1) < 1.
- :func:`takase_fig3_b2t_mitigates` (Fig. 3b): g(1)/g(L) of b2t > that of post_ln.
- :func:`takase_fig4_ln_drops` (Fig. 4/7): g(1)/g(2) < 1 and g(3)/g(4) < 1 at layers
  (1, L//2, L).
- :func:`takase_fig5_pre_ln_higher` (Fig. 5): LL(pre_ln) > LL(post_ln), LL the mean
  cosine over rows i > L/2 and columns j < L/2.
- :func:`takase_fig5_b2t_keeps_post_ln` (Fig. 5c): |LL(b2t) - LL(post_ln)| <
  |LL(pre_ln) - LL(post_ln)|.
- :func:`takase_fig1_convergence` (Fig. 1/6/9): post_ln failed; pre_ln, b2t learned.
- :func:`sweep_post_ln_fails_deep` (Takase Fig. 8, Xu Table 1, Wang Fig. 3): at post_ln's
  deepest depth D it failed while pre_ln and b2t learned.
- :func:`sweep_lipschitz_rescues` (Xu 2020 Table 3): at the deepest common depth,
  post_ln+xavier failed and post_ln+lipschitz learned.
- :func:`wang_embed_grad_collapses_in_training` (Wang 2019 §4.2): in training, the deep
  Post-LN run's embedding gradient < 1e-2 × the shallow run's (last quarter of the steps).
- :func:`wang_embed_grad_vanishes` (a control at init): spearman(depth, g(embed.out)) < 0 and
  g(deepest)/g(shallowest) < 1 over >= 3 depths.
- :func:`wang_fig5_dlcl_dense_early` (Wang 2019 Fig. 5): mean masked-row density of early
  rows > that of late rows.
- :func:`wang_fig5_dlcl_near_diagonal` (Wang 2019 Fig. 5): row-normalised |W| mass in a
  diagonal band > 1.25 × its uniform expectation.
- :func:`xu_table2_post_ln_shrinks` (Xu 2020 Table 2): mean w/σ < 1.
- :func:`xu_table2_lipschitz_closer` (Xu 2020 Table 2): mean |1 - w/σ| of the lipschitz
  run < that of the baseline run.
- :func:`nguyen_warmup_free` (Nguyen & Salazar 2019): pre_ln and scalenorm learned;
  post_ln failed.
- :func:`qk_norm_lowers_lr_sensitivity`, :func:`qk_norm_bounds_logits`,
  :func:`z_loss_keeps_log_z_near_zero` (Wortsman 2023 §3.1): qk_norm's LR sensitivity
  E_lr[min(ℓ, ℓ₀) − ℓ*] below plain's; its logit growth below plain's at the two highest
  lrs; z-loss, where it moved |log Z| by >= 0.5 nat, lowers the LR sensitivity.

- :func:`replay_flags_planted_step`, :func:`replay_flags_nothing_else`,
  :func:`replay_rows_equal_recorded` (spike replay, issue 26): the planted spike is flagged,
  nothing else is, and the replayed rows equal an always-recording run's to 1e-6.

A training run's outcome is :func:`run_outcome`, anchored to its task's chance loss and
floor (``gradscope.claims.outcome``): learned, partial, stuck at chance or diverged. Claims
are decided over seeds (``gradscope.claims.seeds``): holds / does not hold only with >= 3
seeds that agree and a margin outside their spread, else inconclusive.
"""

from gradscope.claims.instability import (
    logits_grow_before_divergence,
    lr_sensitivity,
    lr_summary,
    qk_norm_bounds_logits,
    qk_norm_lowers_lr_sensitivity,
    z_loss_keeps_log_z_near_zero,
)
from gradscope.claims.matrices import (
    lower_left_mean,
    row_density,
    takase_fig5_b2t_keeps_post_ln,
    takase_fig5_pre_ln_higher,
    wang_fig5_dlcl_dense_early,
    wang_fig5_dlcl_near_diagonal,
)
from gradscope.claims.profiles import (
    takase_fig3_b2t_mitigates,
    takase_fig3_post_ln_vanishing,
    takase_fig3_pre_ln_decay,
    takase_fig4_ln_drops,
    wang_embed_grad_collapses_in_training,
    wang_embed_grad_vanishes,
    xu_table2_lipschitz_closer,
    xu_table2_post_ln_shrinks,
)
from gradscope.claims.replay import replay_flags_nothing_else, replay_flags_planted_step, replay_rows_equal_recorded
from gradscope.claims.outcome import CHANCE_GAP, LEARNED_GAP, RunOutcome, classify, run_outcome
from gradscope.claims.seeds import MIN_SEEDS, by_seed, combine, over_seeds, seed_run, split_run, with_quote
from gradscope.claims.training import (
    SUMMARY_COLUMNS,
    nguyen_warmup_free,
    sweep_lipschitz_rescues,
    sweep_post_ln_fails_deep,
    sweep_summary,
    takase_fig1_convergence,
)
from gradscope.claims.verdict import CONTROL, Verdict, verdict_line, write_claims
from gradscope.table import SWEEP_COLUMNS

__all__ = [
    "CHANCE_GAP",
    "CONTROL",
    "LEARNED_GAP",
    "MIN_SEEDS",
    "SUMMARY_COLUMNS",
    "SWEEP_COLUMNS",
    "RunOutcome",
    "Verdict",
    "by_seed",
    "classify",
    "combine",
    "over_seeds",
    "seed_run",
    "split_run",
    "with_quote",
    "logits_grow_before_divergence",
    "lower_left_mean",
    "lr_sensitivity",
    "lr_summary",
    "nguyen_warmup_free",
    "qk_norm_bounds_logits",
    "qk_norm_lowers_lr_sensitivity",
    "replay_flags_nothing_else",
    "replay_flags_planted_step",
    "replay_rows_equal_recorded",
    "row_density",
    "run_outcome",
    "sweep_lipschitz_rescues",
    "sweep_post_ln_fails_deep",
    "sweep_summary",
    "takase_fig1_convergence",
    "takase_fig3_b2t_mitigates",
    "takase_fig3_post_ln_vanishing",
    "takase_fig3_pre_ln_decay",
    "takase_fig4_ln_drops",
    "takase_fig5_b2t_keeps_post_ln",
    "takase_fig5_pre_ln_higher",
    "verdict_line",
    "wang_embed_grad_collapses_in_training",
    "wang_embed_grad_vanishes",
    "wang_fig5_dlcl_dense_early",
    "wang_fig5_dlcl_near_diagonal",
    "write_claims",
    "xu_table2_lipschitz_closer",
    "xu_table2_post_ln_shrinks",
    "z_loss_keeps_log_z_near_zero",
]
