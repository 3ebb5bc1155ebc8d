"""Sampled token rows of each layer stack's outputs, for ``cosine`` (Takase 2023 Fig. 5).

S[i, j] = mean over non-pad tokens t of cos(y_i[t], y_j[t]), y_0 the embedding output and
y_i layer i's output. Every token is used when the batch has at most ``tokens`` of them,
else ``tokens`` tokens stratified over the batch (evenly spaced, with one random offset per
step drawn by the Recorder's own generator). The normalised rows are written in place into
device buffers during the forward (traceable by Dynamo); the matrices are formed at the
end of the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradscope.recorder.discovery.layout import Layout


class CosineRows:
    """The sampled, normalised rows of every stack output in one step.

    Args:
        layout: its stacks (site names in depth order, and their width).
    """

    def __init__(self, layout: Layout) -> None:
        self._stack_pos = {s: (st.name, i) for st in layout.stacks for i, s in enumerate(st.sites)}
        self._widths = {st.name: (st.width, len(st.sites)) for st in layout.stacks}
        self.rows: dict[str, torch.Tensor] = {}  # stack -> (L+1, k, d) normalised sampled rows
        self.weight: dict[str, torch.Tensor] = {}  # stack -> (k,) token weights (0 = padding)
        self.written: dict[str, torch.Tensor] = {}  # stack -> (L+1,) 1 where that output was sampled
        self.offset: torch.Tensor | None = None  # () in [0, 1): stratified token sampling offset
        self.tokens = 0
        self.masks: dict[str, torch.Tensor] = {}  # stack -> (B, T) bool mask of real tokens

    def forget(self) -> None:
        """Drops the buffers (the device changed)."""
        self.rows, self.weight, self.written = {}, {}, {}

    def begin(self, device: torch.device, tokens: int, generator: torch.Generator) -> None:
        """Zeroed buffers for a step that takes ``cosine``, and this step's sampling offset."""
        self.tokens = tokens
        self.offset = torch.rand((), generator=generator).to(device)
        for name, (width, n) in self._widths.items():
            if width is not None and name not in self.rows:
                self.rows[name] = torch.zeros(n, tokens, width, device=device)
                self.weight[name] = torch.zeros(tokens, device=device)
                self.written[name] = torch.zeros(n, device=device)
        for name in self.rows:
            self.rows[name].zero_()
            self.weight[name].zero_()
            self.written[name].zero_()

    def sample(self, site: str, t: torch.Tensor) -> None:
        """Takes the sampled rows of ``t`` if ``site`` is a stack output (else nothing)."""
        where = self._stack_pos.get(site)
        if where is None or where[0] not in self.rows:
            return
        stack, pos = where
        rows = self.rows[stack]
        if t.is_nested:  # (nn.TransformerEncoder's fast path: the real tokens of each sequence, packed)
            flat = torch.cat([x.reshape(-1, x.shape[-1]) for x in t.detach().unbind()])
        else:
            flat = t.detach().reshape(-1, t.shape[-1])  # (B*T, d)
        if flat.shape[1] != rows.shape[2]:
            return  # the stack changes width: no cosine
        n, k = flat.shape[0], self.tokens
        if n <= k:  # every token, once
            idx = torch.arange(n, device=flat.device)
        else:
            idx = ((torch.arange(k, device=flat.device) + self.offset) * (n / k)).long().clamp_(max=n - 1)
        m = idx.shape[0]
        rows[pos, :m] = F.normalize(flat[idx].float(), dim=-1)
        self.written[stack][pos] = 1.0
        if pos == 0:
            mask = self.masks.get(stack)
            if mask is not None and mask.numel() == n:
                self.weight[stack][:m] = mask.reshape(-1).to(flat.device)[idx].float()
            else:
                self.weight[stack][:m] = 1.0

    def matrices(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Stack -> (S, written): S[i, j] = weighted mean over sampled tokens of
        cos(y_i[t], y_j[t]); ``written`` marks the outputs sampled this step (a matrix with
        an unwritten row is dropped on the host)."""
        out = {}
        for name, Y in self.rows.items():
            w = self.weight[name]
            out[name] = (torch.einsum("ikd,jkd,k->ij", Y, Y, w) / w.sum().clamp_min(1.0), self.written[name])
        return out


def token_masks(model: nn.Module, stacks: list[str], forward_params: list[str], args: tuple,
                kwargs: dict) -> dict[str, torch.Tensor]:
    """Stack -> (B, T) bool mask of real tokens for ``cosine``, asked of the model
    (``model.token_masks(*args, **kwargs)``) or, for HuggingFace models, ``attention_mask``
    for the first (encoder) stack and ``decoder_attention_mask`` for a second: an encoder's
    padding never weights a decoder. ``forward_params``: the forward's parameter names, to
    find a mask passed by position."""
    own = getattr(model, "token_masks", None)
    if callable(own):
        return own(*args, **kwargs)
    masks = {}
    for name, key in zip(stacks, ("attention_mask", "decoder_attention_mask")):
        mask = kwargs.get(key)
        at = forward_params.index(key) if key in forward_params else len(args)
        if mask is None and at < len(args):
            mask = args[at]  # passed by position
        if isinstance(mask, torch.Tensor):
            masks[name] = mask.bool()
    return masks

