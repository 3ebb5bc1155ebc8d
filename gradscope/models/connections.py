"""How a stack connects its layers: plain stacking, DLCL, and transparent attention.

A connection runs the layers of one stack (``run``) and returns the stack output before the
final norm. DLCL (Wang 2019 §3) feeds layer l+1 a learned linear combination of all earlier
layer outputs; transparent attention (Bapna 2018) gives each decoder layer its own weighted
sum of encoder layer outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gradscope.models.sublayers import Context
from gradscope.models.sites import Site, SiteNorm

StackRun = tuple[torch.Tensor, list[torch.Tensor]]  # (stack output, [y_0, ..., y_L])


class Sequential(nn.Module):
    """Plain stacking: x_{l+1} = layer_l(x_l)."""

    def run(self, layers: Sequence[nn.Module], x0: torch.Tensor, ctxs: Sequence[Context]) -> StackRun:
        """Runs the layers; returns (y_L, [y_0, y_1, ..., y_L]), y_0 the embedding output."""
        ys = [x0]
        for layer, ctx in zip(layers, ctxs):
            ys.append(layer(ys[-1], ctx))
        return ys[-1], ys


def dlcl_weight_init(n_layers: int, kind: str) -> torch.Tensor:
    """Initial DLCL weights W, (L+1)×(L+1) lower triangular incl. the diagonal.

    ``avg``: W[r,k] = 1/(r+1); ``one``: W[r,k] = 1 (Wang 2019 §3.1 and Table 6).
    """
    rows = torch.arange(n_layers + 1, dtype=torch.float32)[:, None]
    full = 1.0 / (rows + 1.0) if kind == "avg" else torch.ones(n_layers + 1, 1)
    return torch.tril(full.expand(n_layers + 1, n_layers + 1).clone())


class DLCL(nn.Module):
    """Dynamic linear combination of layers (Wang 2019 Eq. 6–8), shared by both norm placements.

    Row r of W mixes the history [z_0, ..., z_r] into the input of layer r+1; row L gives
    the stack output. ``weight`` is a Parameter when learnable, else a buffer. Upper-triangle
    entries are ignored (and receive no gradient).

    Sites: ``combine.out`` (stack output of the combination, before the stack's final norm),
    and each extra norm's ``combine.norms.<k>.in/out``.

    Args:
        n_layers: L.
        d_model: width d (for the extra norms).
        weight_init: ``"avg"`` or ``"one"``.
        learnable: whether W is trained.
        norms: the L+1 extra normalisation modules, or None when disabled.
    """

    def __init__(self, n_layers: int, weight_init: str, learnable: bool, norms: dict[str, nn.Module] | None) -> None:
        super().__init__()
        w = dlcl_weight_init(n_layers, weight_init)
        if learnable:
            self.weight = nn.Parameter(w)
        else:
            self.register_buffer("weight", w)
        self.register_buffer("mask", torch.tril(torch.ones_like(w)), persistent=False)
        self.norms = nn.ModuleDict({k: SiteNorm(m) for k, m in (norms or {}).items()})
        self.out = Site()

    def mixing_weights(self) -> torch.Tensor:
        """The effective W (lower triangle), (L+1)×(L+1)."""
        return self.weight * self.mask

    def mix(self, r: int, history: Sequence[torch.Tensor]) -> torch.Tensor:
        """Σ_{k≤r} W[r,k]·history[k]."""
        w = self.weight[r]
        out = w[0] * history[0]
        for k in range(1, r + 1):
            out = out + w[k] * history[k]
        return out

    def normed(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """Applies extra norm ``key`` when present."""
        return self.norms[key](x) if key in self.norms else x


class DLCLPre(DLCL):
    """Pre-norm DLCL: x_{l+1} = Σ_{k≤l} W[l,k]·LN_k(y_k), LN_0 = identity (embedding not normalised).

    Extra norms are keyed "1".."L" (one per layer output).
    """

    def run(self, layers: Sequence[nn.Module], x0: torch.Tensor, ctxs: Sequence[Context]) -> StackRun:
        """Runs the layers; returns (combine.out, [y_0, ..., y_L])."""
        history, ys = [x0], [x0]
        x = self.mix(0, history)
        for l, (layer, ctx) in enumerate(zip(layers, ctxs), start=1):
            y = layer(x, ctx)
            ys.append(y)
            history.append(self.normed(str(l), y))
            x = self.mix(l, history)
        return self.out(x), ys


class DLCLPost(DLCL):
    """Post-norm DLCL: x_{l+1} = LN'_l(Σ_{k≤l} W[l,k]·y_k); output LN'_L(Σ_k W[L,k]·y_k).

    Extra norms are keyed "1".."L" (one per combination after a layer); x_1 = W[0,0]·y_0, the
    embedding unnormalised, as Wang 2019's official code; with ``dlcl_embed_ln`` a norm "0"
    normalises it too.
    """

    def run(self, layers: Sequence[nn.Module], x0: torch.Tensor, ctxs: Sequence[Context]) -> StackRun:
        """Runs the layers; returns (combine.out, [y_0, ..., y_L])."""
        ys = [x0]
        x = self.normed("0", self.mix(0, ys))
        for l, (layer, ctx) in enumerate(zip(layers, ctxs), start=1):
            ys.append(layer(x, ctx))
            x = self.normed(str(l), self.mix(l, ys))
        return self.out(x), ys


class SharedMemory(nn.Module):
    """Every decoder layer reads the encoder's output (Vaswani 2017)."""

    def __init__(self, n_dec: int) -> None:
        super().__init__()
        self.n_dec = n_dec

    def forward(self, enc_out: torch.Tensor, enc_layers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [enc_out] * self.n_dec


class TransparentMemory(nn.Module):
    """Transparent attention: decoder layer j reads Σ_i softmax_i(W[i,j])·y_i (Bapna 2018 Eq. 2).

    W ∈ R^{(N+1)×M} starts at 0 (uniform softmax). Sites: ``out.<j>`` per decoder layer.

    Args:
        n_enc: encoder depth N (outputs y_0..y_N).
        n_dec: decoder depth M.
    """

    def __init__(self, n_enc: int, n_dec: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_enc + 1, n_dec))
        self.out = nn.ModuleList([Site() for _ in range(n_dec)])

    def mixing_weights(self) -> torch.Tensor:
        """softmax over encoder layers i of W[:, j], (N+1)×M."""
        return torch.softmax(self.weight, dim=0)

    def forward(self, enc_out: torch.Tensor, enc_layers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        stacked = torch.stack(list(enc_layers), dim=0)  # (N+1, B, S, d)
        mixed = torch.einsum("ij,ibsd->jbsd", self.mixing_weights(), stacked)  # (M, B, S, d)
        return [site(mixed[j]) for j, site in enumerate(self.out)]
