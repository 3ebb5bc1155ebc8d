"""Shared helpers for the model-zoo tests: every (variant, arch) pair and a tiny config."""

from __future__ import annotations

import torch

import gradscope
from gradscope import ModelConfig, presets

ALL_CASES = [
    (variant, arch)
    for variant, spec in sorted(gradscope.VARIANTS.items())
    for arch in ("encoder_decoder", "decoder", "encoder")
    if arch in spec.archs
]


def tiny(variant: str = "post_ln", arch: str = "encoder_decoder", **overrides) -> ModelConfig:
    """``gradscope.presets.tiny`` made smaller still for the zoo tests (d=16, 2 heads, d_ff=24,
    2+3 layers so the stacks differ in depth, vocab 40, no dropout)."""
    fields = dict(variant=variant, arch=arch, n_enc=2, n_dec=3, d_model=16, d_ff=24, vocab=40, max_len=32)
    return presets.tiny(**{**fields, **overrides})


def batch(config: ModelConfig, seed: int = 0, B: int = 3, S: int = 7, T: int = 6) -> tuple[torch.Tensor, ...]:
    """Model inputs with some padding at the end of the last sequence."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, config.vocab, (B, S), generator=g)
    src[-1, -2:] = config.pad_id
    if config.arch != "encoder_decoder":
        return (src,)
    tgt = torch.randint(3, config.vocab, (B, T), generator=g)
    tgt[-1, -1:] = config.pad_id
    return src, tgt


def loss_of(logits: torch.Tensor, config: ModelConfig, seed: int = 1) -> torch.Tensor:
    """Cross entropy against random targets, mean over all positions."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, config.vocab, logits.shape[:-1], generator=g)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
