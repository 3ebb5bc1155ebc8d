"""Model configuration: one frozen keyword-only dataclass, validated on construction.

The registries it is checked against (``gradscope.models.variants``, ``gradscope.models.inits``)
are imported when a config is made. The models import this module, never the other way
at import time; ``gradscope.config`` re-exports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

DLCL_WEIGHT_INITS: tuple[str, ...] = ("avg", "one")
DS_INIT_FORMS: tuple[str, ...] = ("paper", "code")

# Variant-specific options. ``None`` means "not set": the variant's default applies, and a
# variant that does not take the option rejects any value other than None.
VARIANT_OPTIONS: tuple[str, ...] = ("dlcl_weight_init", "dlcl_learnable", "dlcl_extra_ln", "dlcl_embed_ln", "fixnorm",
                                    "deepnorm_init")
DEEPNORM_INITS: tuple[str, ...] = ("paper", "torchscale")
INIT_OPTIONS: tuple[str, ...] = ("ds_init_form", "ds_init_alpha")


REGISTRY_CHECKS: list[Callable[[ModelConfig], None]] = []
"""Checks of a config against the variant registry (its arch, variant and the variant's
options): :func:`gradscope.models.variants.check_config`, added when that module is
imported, which ``gradscope.models`` does before anything else. The registry names this
class in its builders' signatures, so the class does not import it back."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Everything needed to build one zoo model.

    Args:
        arch: ``"encoder_decoder"`` (``model(src, tgt_in)``), ``"decoder"`` (causal LM,
            ``model(tokens)``) or ``"encoder"`` (masked LM, ``model(tokens)``).
        variant: wiring name, a key of ``gradscope.VARIANTS`` (default ``"post_ln"``).
        init: weight-init name, a key of ``gradscope.INITS`` (default ``"xavier"``).
        n_enc: encoder depth N (used by ``encoder_decoder`` and ``encoder``).
        n_dec: decoder depth M (used by ``encoder_decoder`` and ``decoder``).
        d_model: model width d.
        n_heads: attention heads; must divide ``d_model``.
        d_ff: feed-forward inner width.
        vocab: vocabulary size (shared by source and target; output embedding is tied).
        dropout: residual dropout on every sub-layer output F(x) before the residual add,
            and on the embedding output.
        max_len: longest sequence the sinusoidal position table covers.
        pad_id: padding token; padded keys are masked in attention.
        norm_eps: epsilon of every LayerNorm.
        dlcl_weight_init: DLCL variants only. ``"avg"`` (default, W[r,k]=1/(r+1)) or
            ``"one"`` (all ones) — Wang 2019 Table 6.
        dlcl_learnable: DLCL variants only. Whether W is trained (default True).
        dlcl_extra_ln: DLCL variants only. Whether each layer output gets its own LN
            before the combination (default True; False is Wang's "no extra LN" ablation).
        dlcl_embed_ln: ``dlcl_post`` only. Whether the first combination, the embedding
            alone, gets its own LN'_0 (default False: Wang 2019's official code feeds the
            embedding to layer 1 unnormalised; True is this zoo's earlier form).
        deepnorm_init: ``deepnorm`` only. ``"paper"`` (default): Wang 2022 (DeepNet) Fig. 2's
            pseudocode, xavier_normal with gain β for fc1, fc2, v_proj and out_proj and gain 1
            for q_proj and k_proj; ``"torchscale"``: the released code, q/k/v xavier_uniform
            with gain 1/√2, out_proj gain 1, fc1/fc2 torch's default Linear init, then fc1,
            fc2, out_proj and v_proj (weights and biases) divided by torchscale's init_scale.
        fixnorm: ``scalenorm`` only. L2-normalise word-embedding rows on every forward
            (Nguyen & Salazar 2019 FixNorm; default False).
        b2t_rescale: multiply every in-layer matrix by N^-1/2 after init (B2T's later code;
            default False). Any variant may take it.
        ds_init_form: ``ds_init`` only. ``"paper"`` (default): bound γα/√l, i.e. variance
            scaled by 1/l (Zhang 2019 Eq. 11); ``"code"``: variance scaled by 1/√l, bound
            γα/l^(1/4), as the authors' released code does.
        ds_init_alpha: ``ds_init`` only. The α of DS-Init (default 1.0).
        qk_norm: a LayerNorm over each head's queries and keys before the attention
            logits (QK-LayerNorm; Dehghani et al. 2023, Wortsman et al. 2023). Any variant
            may take it (default False).
        share_embeddings: ``encoder_decoder`` only. One token embedding matrix for source,
            target and output (Press & Wolf 2017 three-way tying, as in the WMT setups of
            Wang 2019 and Takase 2022, whose source and target share one BPE vocabulary;
            default False: the encoder has its own). The encoder's ``embed.tokens`` is the
            decoder's: the parameter is listed once, under ``encoder``.
    """

    arch: str = "encoder_decoder"
    variant: str = "post_ln"
    init: str = "xavier"
    n_enc: int = 6
    n_dec: int = 6
    d_model: int = 512
    n_heads: int = 8
    d_ff: int = 2048
    vocab: int = 1000
    dropout: float = 0.1
    max_len: int = 512
    pad_id: int = 0
    norm_eps: float = 1e-5
    dlcl_weight_init: str | None = None
    dlcl_learnable: bool | None = None
    dlcl_extra_ln: bool | None = None
    dlcl_embed_ln: bool | None = None
    fixnorm: bool | None = None
    deepnorm_init: str | None = None
    b2t_rescale: bool = False
    ds_init_form: str | None = None
    ds_init_alpha: float | None = None
    qk_norm: bool = False
    share_embeddings: bool = False

    def __post_init__(self) -> None:
        from gradscope.models.inits import INITS

        if not REGISTRY_CHECKS:  # (gradscope.models imports the variants, which add theirs)
            raise RuntimeError("gradscope.models.config: import gradscope.models, whose variants check a config")
        for check in REGISTRY_CHECKS:
            check(self)
        check_choice("init", self.init, tuple(INITS))
        if self.uses_encoder:
            _check_positive_int("n_enc", self.n_enc)
        if self.uses_decoder:
            _check_positive_int("n_dec", self.n_dec)
        for name in ("d_model", "n_heads", "d_ff", "vocab", "max_len"):
            _check_positive_int(name, getattr(self, name))
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model: {self.d_model} is not divisible by n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")
        if not 0 <= self.pad_id < self.vocab:
            raise ValueError(f"pad_id: must be in [0, vocab={self.vocab}), got {self.pad_id}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps: must be > 0, got {self.norm_eps}")
        for name in INIT_OPTIONS:
            if getattr(self, name) is not None and self.init != "ds_init":
                raise ValueError(f"{name}: only init='ds_init' takes it, not init={self.init!r}")
        if self.share_embeddings and self.arch != "encoder_decoder":
            raise ValueError(f"share_embeddings: only arch='encoder_decoder' has two embeddings to share, "
                             f"not arch={self.arch!r}")
        if self.dlcl_weight_init is not None:
            check_choice("dlcl_weight_init", self.dlcl_weight_init, DLCL_WEIGHT_INITS)
        if self.deepnorm_init is not None:
            check_choice("deepnorm_init", self.deepnorm_init, DEEPNORM_INITS)
        if self.ds_init_form is not None:
            check_choice("ds_init_form", self.ds_init_form, DS_INIT_FORMS)
        if self.ds_init_alpha is not None and not self.ds_init_alpha > 0:
            raise ValueError(f"ds_init_alpha: must be > 0, got {self.ds_init_alpha}")

    @property
    def uses_encoder(self) -> bool:
        """Whether the model has an encoder stack."""
        return self.arch in ("encoder_decoder", "encoder")

    @property
    def uses_decoder(self) -> bool:
        """Whether the model has a decoder stack."""
        return self.arch in ("encoder_decoder", "decoder")

    def replace(self, **changes) -> "ModelConfig":
        """Returns a copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def check_choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    """Raises ValueError naming ``field`` and the valid ``choices`` when ``value`` is not one."""
    if value not in choices:
        raise ValueError(f"{field}: unknown value {value!r}; valid: {sorted(choices)}")


def _check_positive_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field}: must be an integer >= 1, got {value!r}")
