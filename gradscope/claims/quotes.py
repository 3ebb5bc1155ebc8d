"""The sentence of its paper that each rule checks, by rule name (shown in CLAIMS.md).

Quoted from the papers' text in the project's reading set (Takase 2022, Wang 2019, Xu 2020,
Nguyen & Salazar 2019); Wortsman 2023 from its arXiv text (2309.14322). Every public rule of
``gradscope.claims`` has an entry (a test checks it).
"""

from __future__ import annotations

TAKASE_FIG3 = ("Takase 2022 §3: \"Focus on the decoder-side of Post-LN as illustrated in Figure 3 (b). This figure "
               "shows that shallower layer is, smaller its gradient norm is.\"")
QUOTES: dict[str, str] = {
    "takase_fig3_post_ln_vanishing": TAKASE_FIG3,
    "takase_fig3_pre_ln_decay": ("Takase 2022 §4: \"Focus Pre-LN in Figure 3. In contrast to Post-LN, deeper (higher) "
                                 "layer is, smaller its gradient norm is.\""),
    "takase_fig3_b2t_mitigates": ("Takase 2022 §5: \"In fact, Figure 3 (b) indicates that B2T connection mitigates "
                                  "the vanishing gradient of 18L-18L encoder-decoders.\""),
    "takase_fig4_ln_drops": ("Takase 2022 §3: \"This figure indicates that the gradient norms from (4) to (3) and (2) "
                             "to (1) drastically decrease.\""),
    "takase_fig5_pre_ln_higher": ("Takase 2022 §4: \"This figure indicates that the lower-left similarities of Pre-LN "
                                  "are higher than ones of Post-LN.\""),
    "takase_fig5_b2t_keeps_post_ln": ("Takase 2022 §5: \"Moreover, B2T connection keeps the property of Post-LN on "
                                      "transformations by each layer as in Figure 5 (c).\""),
    "takase_fig1_convergence": ("Takase 2022 §1: \"These figures clearly show that 18L-18L Post-LN Transformer "
                                "encoder-decoder fails to train the model.\" §6.1.3: \"Focus on B2T connection, its "
                                "training succeeded\""),
    "sweep_post_ln_fails_deep": ("Takase 2022 §C (Fig. 8): \"For Post-LN Transformers, the training of the 12L-12L "
                                 "configuration succeeded but the NLL values on validation data diverged in stacking "
                                 "18L-18L or more layers.\""),
    "sweep_lipschitz_rescues": ("Xu 2020 §1: \"We empirically show that with proper parameter initialization, deep "
                                "Transformers with the original computation order can converge\""),
    "wang_embed_grad_vanishes": ("Wang 2019 §4.2: \"When increasing the encoder depth, e.g. L = 20, the vanilla "
                                 "Transformer failed to train [...] We attribute it to the vanishing gradient problem "
                                 "based on the observation that the gradient norm in the low layers (e.g. embedding "
                                 "layer) approaches 0.\""),
    "wang_embed_grad_collapses_in_training": ("Wang 2019 §4.2: \"When increasing the encoder depth, e.g. L = 20, the "
                                              "vanilla Transformer failed to train [...] based on the observation that "
                                              "the gradient norm in the low layers (e.g. embedding layer) approaches "
                                              "0.\""),
    "wang_fig5_dlcl_dense_early": ("Wang 2019 §5.4: \"We can see that the connections in the early layers are dense, "
                                   "but become sparse as the depth increases.\""),
    "wang_fig5_dlcl_near_diagonal": ("Wang 2019 §5.4: \"Also, we find that most of the large weight values "
                                     "concentrate on the right of the matrix, which indicates that the impact of the "
                                     "incoming layer is usually related to the distance between the outgoing layer.\""),
    "xu_table2_post_ln_shrinks": ("Xu 2020 §3.1: \"Table 2 shows that the computation of residual connection in v1 is "
                                  "weighted by w/σ compared to v2, and the residual connection of previous layers will "
                                  "be shrunk in case w/σ < 1.\""),
    "xu_table2_lipschitz_closer": ("Xu 2020 §3.2: \"Since the convergence issue of deep v1 Transformers is likely "
                                   "because of the shrunken residual connections, is it possible to restrict "
                                   "w/σ ≥ 1?\""),
    "nguyen_warmup_free": ("Nguyen & Salazar 2019 §1: \"We show that PRENORM enables warmup-free, validation-based "
                           "training with large learning rates even for small batches\"; §2: \"warmup was needed to "
                           "let LAYERNORM safely adjust scale during early parts of training.\""),
    "logits_grow_before_divergence": ("Wortsman 2023 abstract: \"we show that these instabilities also appear in small "
                                      "models when training at high learning rates\" (§3.1.1: attention logit growth)."),
    "qk_norm_lowers_lr_sensitivity": ("Wortsman 2023 §3.1.1: \"models with qk-layernorm exhibit considerably lower "
                                      "LR sensitivity and train to low loss at high learning rates\""),
    "qk_norm_bounds_logits": ("Wortsman 2023 abstract: \"the growth of logits in attention layers (Dehghani et al., "
                              "2023) [...] we show that these instabilities also appear in small models when training "
                              "at high learning rates, and that mitigations previously employed at large scales are "
                              "equally effective in this regime.\""),
    "z_loss_keeps_log_z_near_zero": ("Wortsman 2023 §3.1.2: \"The mitigation proposed by Chowdhery et al. is to "
                                     "encourage log Z to remain close to zero\"; \"this divergence occurs towards the "
                                     "end of training.\""),
}


def quote_for(rule: str) -> str:
    """The quoted sentence of ``rule`` (a function name of ``gradscope.claims``), or ''."""
    return QUOTES.get(rule, "")
