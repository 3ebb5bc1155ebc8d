"""Named model sizes, as functions returning a ModelConfig (torchtune style).

Each takes keyword overrides: ``presets.base(variant="b2t", n_enc=18, n_dec=18)``.
"""

from __future__ import annotations

from gradscope.config import ModelConfig


def base(**overrides) -> ModelConfig:
    """The papers' base size: d=512, 8 heads, d_ff=2048, 6+6 layers, dropout 0.1 (Vaswani 2017)."""
    return ModelConfig(**{"d_model": 512, "n_heads": 8, "d_ff": 2048, "n_enc": 6, "n_dec": 6, "dropout": 0.1, **overrides})


def small(**overrides) -> ModelConfig:
    """A laptop size: d=128, 4 heads, d_ff=512, 6+6 layers, dropout 0.1."""
    return ModelConfig(**{"d_model": 128, "n_heads": 4, "d_ff": 512, "n_enc": 6, "n_dec": 6, "dropout": 0.1, "max_len": 128, **overrides})


def tiny(**overrides) -> ModelConfig:
    """A CI size: d=32, 2 heads, d_ff=64, 2+2 layers, vocab 64, dropout 0."""
    return ModelConfig(
        **{"d_model": 32, "n_heads": 2, "d_ff": 64, "n_enc": 2, "n_dec": 2, "vocab": 64, "dropout": 0.0, "max_len": 64, **overrides}
    )


PRESETS = {"base": base, "small": small, "tiny": tiny}
