"""Sub-layer functions F: self-attention, cross-attention and the feed-forward network.

Every F has the signature ``F(h, ctx) -> (B, T, d)``; ``ctx`` carries masks and memory so
that wirings can treat all sub-layers alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Context:
    """What a layer's sub-layers need besides the residual stream.

    Attributes:
        self_mask: bool mask broadcastable to (B, 1, T, T), True where attention is allowed.
        memory: encoder output the cross-attention reads, (B, S, d), or None.
        memory_mask: bool mask broadcastable to (B, 1, T, S), or None.
    """

    self_mask: torch.Tensor | None
    memory: torch.Tensor | None = None
    memory_mask: torch.Tensor | None = None


class MultiheadAttention(nn.Module):
    """Multi-head attention on ``F.scaled_dot_product_attention``.

    Separate q/k/v/out projections (fairseq naming), so inits can treat them apart.

    Args:
        d_model: width d.
        n_heads: number of heads; d must be divisible by it.
        qk_norm: a LayerNorm over each head's q and k before the logits (QK-LayerNorm;
            Dehghani et al. 2023, Wortsman et al. 2023 §3.1), modules ``q_norm``/``k_norm``.
        eps: epsilon of those LayerNorms.
    """

    is_causal = False  # (a causal mask comes with the call, as HF's modules say; the recorder's signals read it)

    def __init__(self, d_model: int, n_heads: int, qk_norm: bool = False, eps: float = 1e-5) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        if qk_norm:
            self.q_norm = nn.LayerNorm(d_model // n_heads, eps=eps)
            self.k_norm = nn.LayerNorm(d_model // n_heads, eps=eps)

    def forward(self, x: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, d = x.shape
        S = kv.shape[1]
        H = self.n_heads
        q = self.q_proj(x).view(B, T, H, d // H)
        k = self.k_proj(kv).view(B, S, H, d // H)
        if "q_norm" in self._modules:  # QK-LayerNorm, per head
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, d/H), (B, H, S, d/H)
        v = self.v_proj(kv).view(B, S, H, d // H).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, d/H)
        return self.out_proj(o.transpose(1, 2).reshape(B, T, d))


class SelfAttention(nn.Module):
    """F = self-attention over the residual stream, masked by ``ctx.self_mask``."""

    def __init__(self, d_model: int, n_heads: int, qk_norm: bool = False, eps: float = 1e-5) -> None:
        super().__init__()
        self.attn = MultiheadAttention(d_model, n_heads, qk_norm, eps)

    def forward(self, h: torch.Tensor, ctx: Context) -> torch.Tensor:
        return self.attn(h, h, ctx.self_mask)


class CrossAttention(nn.Module):
    """F = attention from the decoder stream to ``ctx.memory``."""

    def __init__(self, d_model: int, n_heads: int, qk_norm: bool = False, eps: float = 1e-5) -> None:
        super().__init__()
        self.attn = MultiheadAttention(d_model, n_heads, qk_norm, eps)

    def forward(self, h: torch.Tensor, ctx: Context) -> torch.Tensor:
        return self.attn(h, ctx.memory, ctx.memory_mask)


class FeedForward(nn.Module):
    """F = fc2(ReLU(fc1(h))), the position-wise FFN of Vaswani 2017 Eq. 2."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, h: torch.Tensor, ctx: Context) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(h)))
