"""Token embedding: sqrt(d)·E[token] + sinusoidal position (Vaswani 2017 §3.4, §3.5)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gradscope.models.sites import Site


def sinusoidal_positions(max_len: int, d_model: int) -> torch.Tensor:
    """PE[pos, 2i] = sin(pos/10000^(2i/d)), PE[pos, 2i+1] = cos(...) — Vaswani 2017 §3.5.

    Returns:
        Tensor (max_len, d_model).
    """
    pos = torch.arange(max_len, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div[: d_model // 2])
    return pe


class Embedding(nn.Module):
    """sqrt(d)·E[token] + PE[position], then dropout; site ``out`` is y_0.

    Args:
        vocab: vocabulary size.
        d_model: width d.
        max_len: longest sequence.
        dropout: dropout on the output.
    """

    def __init__(self, vocab: int, d_model: int, max_len: int, dropout: float) -> None:
        super().__init__()
        self.scale = math.sqrt(d_model)
        self.tokens = nn.Embedding(vocab, d_model)
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        self.drop = nn.Dropout(dropout)
        self.out = Site()

    def token_weight(self) -> torch.Tensor:
        """The embedding matrix E (vocab, d) as used in forward and by the tied output layer."""
        return self.tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        if T > self.positions.shape[0]:
            raise ValueError(f"sequence length {T} exceeds max_len={self.positions.shape[0]}")
        x = self.scale * F.embedding(tokens, self.token_weight()) + self.positions[:T]
        return self.out(self.drop(x))  # (B, T, d)


class FixNormEmbedding(Embedding):
    """FixNorm: every word-embedding row L2-normalised on each forward (Nguyen & Salazar 2019 §2.3)."""

    def token_weight(self) -> torch.Tensor:
        return F.normalize(self.tokens.weight, dim=-1)
