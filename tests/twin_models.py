"""Residual models (Linear after LayerNorm) small enough to compile in a test."""

from __future__ import annotations

from torch import nn


class TwinBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class Twin(nn.Module):
    """Two :class:`TwinBlock`; input and output (B, T, 8)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([TwinBlock() for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class TanhBlock(nn.Module):
    """``h + tanh(fc(ln(h)))`` of width ``d``: its LayerNorm's input and output are sites."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, h):
        return h + self.fc(self.ln(h)).tanh()
