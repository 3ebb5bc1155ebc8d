"""The variant registry: each wiring is a small class answering the same questions.

A variant says, for one stack, how to wrap each sub-layer function (norm placement, skip
and branch scaling), how layers connect (plain, DLCL), whether there is a final norm, how
the decoder reads the encoder, and which weights it rescales after the base init. The
builder (``gradscope.models.build``) asks these questions; no ``forward`` branches on a
variant name. Formulas cite their paper and equation.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from gradscope.models import connections, norms, residual
from gradscope.models.config import REGISTRY_CHECKS, VARIANT_OPTIONS, ModelConfig, check_choice
from gradscope.models.embedding import Embedding, FixNormEmbedding
from gradscope.models.rescale import deepnorm_paper_init, deepnorm_torchscale_init, tfixup_rescale, torchscale_init_scale


ARCHS: tuple[str, ...] = ("encoder_decoder", "decoder", "encoder")
"""The model shapes the zoo builds: ``model(src, tgt_in)``, a causal LM and a masked LM."""


@dataclass(frozen=True)
class StackSpec:
    """What a variant needs to know about the stack it wires.

    Attributes:
        name: ``"encoder"`` or ``"decoder"``.
        depth: number of layers of this stack (N or M).
        config: the model config.
    """

    name: str
    depth: int
    config: ModelConfig


class Variant:
    """Base wiring: Post-LN (Vaswani 2017): h = LN1(x + SA(x)); y = LN2(h + FFN(h)).

    Subclasses override only what differs. ``options`` lists the ModelConfig variant
    options this variant takes; ``archs`` the model shapes it exists for.
    """

    archs: tuple[str, ...] = ARCHS
    options: frozenset[str] = frozenset()
    sublayer_class: type[residual.Sublayer] = residual.PostNormSublayer

    def norm(self, spec: StackSpec) -> nn.Module | None:
        """The in-layer normalisation module, or None for a norm-free wiring."""
        return norms.layer_norm(spec.config.d_model, spec.config.norm_eps)

    def skip(self, spec: StackSpec) -> nn.Module | None:
        """Module applied to each sub-layer's skip path x (None: identity)."""
        return None

    def layer_gate(self, spec: StackSpec) -> nn.Module | None:
        """A gate shared by all sub-layers of one layer, applied to F(x) (None: identity)."""
        return None

    def last_layer_skip(self, spec: StackSpec) -> nn.Module | None:
        """How the last sub-layer of a layer adds the layer input (None: it does not)."""
        return None

    def sublayer(self, fn: nn.Module, spec: StackSpec, *, last: bool, gate: nn.Module | None) -> nn.Module:
        """Wraps branch ``fn`` into a residual sub-layer."""
        return self.sublayer_class(
            fn,
            norm=self.norm(spec),
            skip=self.skip(spec),
            gate=gate,
            layer_skip=self.last_layer_skip(spec) if last else None,
            dropout=spec.config.dropout,
        )

    def connection(self, spec: StackSpec) -> nn.Module:
        """How the stack's layers are connected."""
        return connections.Sequential()

    def final_norm(self, spec: StackSpec) -> nn.Module | None:
        """The norm after the last layer, or None."""
        return None

    def embedding(self, config: ModelConfig) -> nn.Module:
        """The token embedding of each stack."""
        return Embedding(config.vocab, config.d_model, config.max_len, config.dropout)

    def memory(self, config: ModelConfig) -> nn.Module:
        """How decoder layers read the encoder (encoder–decoder only)."""
        return connections.SharedMemory(config.n_dec)

    def rescale(self, model: nn.Module, config: ModelConfig) -> None:
        """Adjusts weights after the base init (default: nothing)."""


class PostLN(Variant):
    """``post_ln``: Vaswani 2017; no final LN."""


class PreLN(Variant):
    """``pre_ln``: x ← x + F(LN(x)) per sub-layer, one final LN per stack (Wang 2019 Eq. 4)."""

    sublayer_class = residual.PreNormSublayer

    def final_norm(self, spec: StackSpec) -> nn.Module | None:
        return self.norm(spec)


class B2T(PostLN):
    """``b2t``: Post-LN whose last LN also sees the layer input: y = LN2(x + h + FFN(h)) (Takase 2022 Eq. 5)."""

    def last_layer_skip(self, spec: StackSpec) -> nn.Module | None:
        return residual.BottomToTop(alpha=1.0, beta=1.0)


def b2t_noln_coefficients(depth: int, d_model: int) -> tuple[float, float]:
    """α = min(N/12, N^-0.15), β = d^-0.2 (Takase 2022 App. D Eq. 7–8)."""
    return min(depth / 12, depth**-0.15), d_model**-0.2


class B2TNoLN(PostLN):
    """``b2t_noln``: no in-layer LN; y = α·x + β·(h + FFN(h)), h = x + SA(x) (Takase App. D Eq. 6)."""

    def norm(self, spec: StackSpec) -> nn.Module | None:
        return None

    def last_layer_skip(self, spec: StackSpec) -> nn.Module | None:
        alpha, beta = b2t_noln_coefficients(spec.depth, spec.config.d_model)
        return residual.BottomToTop(alpha=alpha, beta=beta)


DLCL_OPTIONS = frozenset({"dlcl_weight_init", "dlcl_learnable", "dlcl_extra_ln"})


class _DLCL:
    """The DLCL options (Wang 2019 Table 6; defaults avg, learnable, extra LN) and the
    connection built from them. ``extra_from``: the first layer output that gets its own LN."""

    options = DLCL_OPTIONS
    connection_class: type[nn.Module]
    extra_from: int

    def connection(self, spec: StackSpec) -> nn.Module:
        config = spec.config
        init = config.dlcl_weight_init or "avg"
        learnable = True if config.dlcl_learnable is None else config.dlcl_learnable
        extra_ln = True if config.dlcl_extra_ln is None else config.dlcl_extra_ln
        extra = {str(k): self.norm(spec) for k in range(self.first_extra(config), spec.depth + 1)} if extra_ln else None
        return self.connection_class(spec.depth, init, learnable, extra)

    def first_extra(self, config: ModelConfig) -> int:
        """The first combination (or layer output) with its own LN."""
        return self.extra_from


class DLCLPreVariant(_DLCL, PreLN):
    """``dlcl_pre``: Pre-LN layers combined by DLCL with per-output LN_k (Wang 2019 §3, Eq. 6)."""

    connection_class = connections.DLCLPre
    extra_from = 1  # y_0, the embedding, is not normalised


class DLCLPostVariant(_DLCL, PostLN):
    """``dlcl_post``: Post-LN layers, x_{l+1} = LN'_l(Σ_k W[l,k]·y_k) (Wang 2019 §3)."""

    connection_class = connections.DLCLPost
    options = DLCL_OPTIONS | {"dlcl_embed_ln"}
    extra_from = 1  # the official code: the embedding enters layer 1 without an LN'_0

    def first_extra(self, config: ModelConfig) -> int:
        return 0 if config.dlcl_embed_ln else 1


class TransparentAttention(PostLN):
    """``transparent_attention``: Post-LN; decoder layer j reads Σ_i softmax_i(W[i,j])·y_i (Bapna 2018)."""

    archs = ("encoder_decoder",)

    def memory(self, config: ModelConfig) -> nn.Module:
        return connections.TransparentMemory(config.n_enc, config.n_dec)


class ScaleNormVariant(PreLN):
    """``scalenorm``: Pre-LN with ScaleNorm g·x/‖x‖ everywhere (Nguyen & Salazar 2019); FixNorm option."""

    options = frozenset({"fixnorm"})

    def norm(self, spec: StackSpec) -> nn.Module | None:
        return norms.scale_norm(spec.config.d_model, spec.config.norm_eps)

    def embedding(self, config: ModelConfig) -> nn.Module:
        cls = FixNormEmbedding if config.fixnorm else Embedding
        return cls(config.vocab, config.d_model, config.max_len, config.dropout)


class Admin(PostLN):
    """``admin``: x_i = LN(F_i(x_{i-1}) + ω_i ⊙ x_{i-1}) (Liu 2020 Eq. 6); ω set by ``admin_init``."""

    def skip(self, spec: StackSpec) -> nn.Module | None:
        return residual.VectorScale(spec.config.d_model)


def deepnorm_coefficients(config: ModelConfig, stack: str) -> tuple[float, float]:
    """DeepNorm (α, β) for one stack (Wang 2022 DeepNet Fig. 2 / torchscale).

    Encoder-only: α=(2N)^¼, β=(8N)^-¼. Decoder-only: α=(2M)^¼, β=(8M)^-¼.
    Encoder–decoder: encoder α=0.81(N⁴M)^(1/16), β=0.87(N⁴M)^(-1/16); decoder α=(3M)^¼, β=(12M)^-¼.
    """
    N, M = config.n_enc, config.n_dec
    if config.arch == "encoder_decoder":
        if stack == "encoder":
            return 0.81 * (N**4 * M) ** (1 / 16), 0.87 * (N**4 * M) ** (-1 / 16)
        return (3 * M) ** 0.25, (12 * M) ** -0.25
    depth = N if config.arch == "encoder" else M
    return (2 * depth) ** 0.25, (8 * depth) ** -0.25


class DeepNorm(PostLN):
    """``deepnorm``: x ← LN(α·x + F(x)); the layers' linears initialised with β (Wang 2022
    DeepNet Fig. 2's pseudocode, or torchscale's form: ``deepnorm_init``)."""

    options = frozenset({"deepnorm_init"})

    def skip(self, spec: StackSpec) -> nn.Module | None:
        return residual.ConstScale(deepnorm_coefficients(spec.config, spec.name)[0])

    def rescale(self, model: nn.Module, config: ModelConfig) -> None:
        if (config.deepnorm_init or "paper") == "torchscale":
            deepnorm_torchscale_init(model, {name: torchscale_init_scale(config, name) for name in model.stacks()})
        else:
            deepnorm_paper_init(model, {name: deepnorm_coefficients(config, name)[1] for name in model.stacks()})


class TFixup(PostLN):
    """``tfixup``: no LN anywhere, x + F(x), with T-Fixup's init scaling (Huang 2020 §3.2)."""

    def norm(self, spec: StackSpec) -> nn.Module | None:
        return None

    def rescale(self, model: nn.Module, config: ModelConfig) -> None:
        tfixup_rescale(model, config)


class ReZero(PostLN):
    """``rezero``: x + α·F(x), one scalar α per layer shared by its sub-layers, init 0, no LN
    (Bachlechner 2020 Eq. 5; as the authors' RZTX layers share ``resweight``)."""

    def norm(self, spec: StackSpec) -> nn.Module | None:
        return None

    def layer_gate(self, spec: StackSpec) -> nn.Module | None:
        return residual.ScalarGate()


VARIANTS: dict[str, Variant] = {
    "post_ln": PostLN(),
    "pre_ln": PreLN(),
    "b2t": B2T(),
    "b2t_noln": B2TNoLN(),
    "dlcl_pre": DLCLPreVariant(),
    "dlcl_post": DLCLPostVariant(),
    "transparent_attention": TransparentAttention(),
    "scalenorm": ScaleNormVariant(),
    "admin": Admin(),
    "deepnorm": DeepNorm(),
    "tfixup": TFixup(),
    "rezero": ReZero(),
}


def check_config(config: ModelConfig) -> None:
    """Raises ValueError naming the field when ``config``'s arch, variant or a variant option
    is not in the registry (:data:`ARCHS`, :data:`VARIANTS`), with the valid choices."""
    check_choice("arch", config.arch, ARCHS)
    check_choice("variant", config.variant, tuple(VARIANTS))
    variant = VARIANTS[config.variant]
    if config.arch not in variant.archs:
        raise ValueError(f"arch: variant {config.variant!r} exists for {list(variant.archs)}, not {config.arch!r}")
    for name in VARIANT_OPTIONS:
        if getattr(config, name) is not None and name not in variant.options:
            takers = sorted(n for n, v in VARIANTS.items() if name in v.options)
            raise ValueError(f"{name}: variant {config.variant!r} does not take it (only {takers} do)")


REGISTRY_CHECKS.append(check_config)
