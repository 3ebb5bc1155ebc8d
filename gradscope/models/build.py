"""``build_model``: assembles a zoo model from a ModelConfig, then initialises it."""

from __future__ import annotations

from gradscope.models.config import ModelConfig
from gradscope.models.sublayers import CrossAttention, FeedForward, SelfAttention
from gradscope.models.inits import INITS
from gradscope.models.rescale import b2t_rescale
from gradscope.models.stack import Layer, Stack
from gradscope.models.transformer import DecoderLM, EncoderDecoder, EncoderMLM, ZooModel
from gradscope.models.variants import VARIANTS, StackSpec, Variant


def build_layer(variant: Variant, spec: StackSpec, *, cross: bool):
    """One layer: self-attention, cross-attention (decoder of encoder–decoder), FFN."""
    c = spec.config
    fns = {"self_attn": SelfAttention(c.d_model, c.n_heads, c.qk_norm, c.norm_eps)}
    if cross:
        fns["cross_attn"] = CrossAttention(c.d_model, c.n_heads, c.qk_norm, c.norm_eps)
    fns["ffn"] = FeedForward(c.d_model, c.d_ff)
    gate = variant.layer_gate(spec)
    last = list(fns)[-1]
    return Layer({name: variant.sublayer(fn, spec, last=name == last, gate=gate) for name, fn in fns.items()})


def build_stack(variant: Variant, spec: StackSpec, *, cross: bool) -> Stack:
    """Embedding, ``spec.depth`` layers, the variant's connection and final norm."""
    layers = [build_layer(variant, spec, cross=cross) for _ in range(spec.depth)]
    return Stack(variant.embedding(spec.config), layers, variant.connection(spec), variant.final_norm(spec))


def build_model(config: ModelConfig) -> ZooModel:
    """Builds and initialises the model ``config`` describes.

    Order: modules → base init (``INITS[config.init]``) → ``b2t_rescale`` if set → the
    variant's own rescaling (DeepNorm β, T-Fixup). Seed with ``torch.manual_seed`` first
    for reproducible weights.

    Args:
        config: the model config.

    Returns:
        ``EncoderDecoder``, ``DecoderLM`` or ``EncoderMLM``; ``model.config`` is ``config``.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected ModelConfig, got {type(config).__name__}")
    variant = VARIANTS[config.variant]
    if config.arch == "encoder_decoder":
        model = EncoderDecoder(
            build_stack(variant, StackSpec("encoder", config.n_enc, config), cross=False),
            build_stack(variant, StackSpec("decoder", config.n_dec, config), cross=True),
            variant.memory(config),
            config.pad_id,
        )
        if config.share_embeddings:  # (before init, so every init sees one matrix)
            model.decoder.embed.tokens = model.encoder.embed.tokens
    elif config.arch == "decoder":
        model = DecoderLM(build_stack(variant, StackSpec("decoder", config.n_dec, config), cross=False), config.pad_id)
    else:
        model = EncoderMLM(build_stack(variant, StackSpec("encoder", config.n_enc, config), cross=False), config.pad_id)
    INITS[config.init](model, config)
    if config.b2t_rescale:
        b2t_rescale(model)
    variant.rescale(model, config)
    model.config = config
    return model
