"""The three model shapes: encoder–decoder, decoder-only LM, encoder-only masked LM.

Calling conventions:
    ``EncoderDecoder``: ``model(src (B, S), tgt_in (B, T)) -> logits (B, T, vocab)``.
    ``DecoderLM``: ``model(tokens (B, T)) -> logits (B, T, vocab)``, causal.
    ``EncoderMLM``: ``model(tokens (B, T)) -> logits (B, T, vocab)``, bidirectional.
Padding (``pad_id``) keys are masked. The output layer is tied to the (last) embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradscope.models.sublayers import Context
from gradscope.models.stack import Stack


def key_mask(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, 1, 1, S) bool, True where the key is not padding."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, 1, T, T) bool: causal and not padding; the diagonal always allowed, so a padded
    query row never has every key masked (which would give NaN in softmax)."""
    T = tokens.shape[1]
    tri = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=tokens.device)
    return (key_mask(tokens, pad_id) & tri) | eye


class ZooModel(nn.Module):
    """Base of the zoo models; ``stacks()`` lists the stacks by name."""

    pad_id: int
    # No op of the zoo modifies a Site's output in place, so the recorder may read a Site's
    # gradient eagerly at a cheap alias of its output (asked for by name; see recorder/capture/eager.py).
    site_outputs_never_modified_in_place = True

    def stacks(self) -> dict[str, Stack]:
        """Name → stack, encoder first."""
        return {name: m for name, m in self.named_children() if isinstance(m, Stack)}

    def stack_tokens(self, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Stack name → the (B, T) token tensor it reads, for the inputs of one forward."""
        return dict(zip(self.stacks(), inputs))

    def token_masks(self, *inputs: torch.Tensor, **kwargs) -> dict[str, torch.Tensor]:
        """Stack name → (B, T) bool mask of real (non-pad) tokens; the recorder weights
        ``cosine`` by it."""
        return {s: t != self.pad_id for s, t in self.stack_tokens(*inputs).items()}


class EncoderDecoder(ZooModel):
    """Encoder–decoder translation model (Vaswani 2017).

    Args:
        encoder: encoder stack.
        decoder: decoder stack (its layers have cross-attention).
        memory: maps (encoder output, encoder layer outputs) to one memory per decoder
            layer (shared, or transparent attention).
        pad_id: padding token.
    """

    def __init__(self, encoder: Stack, decoder: Stack, memory: nn.Module, pad_id: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.memory = memory
        self.pad_id = pad_id

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        src_keep = key_mask(src, self.pad_id)
        enc_ctx = Context(self_mask=src_keep)
        enc_out, enc_ys = self.encoder(src, [enc_ctx] * len(self.encoder.layers))  # (B, S, d)
        memories = self.memory(enc_out, enc_ys)
        self_mask = causal_mask(tgt_in, self.pad_id)
        dec_ctxs = [Context(self_mask, memory=m, memory_mask=src_keep) for m in memories]
        y, _ = self.decoder(tgt_in, dec_ctxs)  # (B, T, d)
        return F.linear(y, self.decoder.embed.token_weight())  # (B, T, vocab)


class DecoderLM(ZooModel):
    """Decoder-only causal language model."""

    def __init__(self, decoder: Stack, pad_id: int) -> None:
        super().__init__()
        self.decoder = decoder
        self.pad_id = pad_id

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ctx = Context(self_mask=causal_mask(tokens, self.pad_id))
        y, _ = self.decoder(tokens, [ctx] * len(self.decoder.layers))
        return F.linear(y, self.decoder.embed.token_weight())


class EncoderMLM(ZooModel):
    """Encoder-only masked language model (logits at every position)."""

    def __init__(self, encoder: Stack, pad_id: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.pad_id = pad_id

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ctx = Context(self_mask=key_mask(tokens, self.pad_id))
        y, _ = self.encoder(tokens, [ctx] * len(self.encoder.layers))
        return F.linear(y, self.encoder.embed.token_weight())
