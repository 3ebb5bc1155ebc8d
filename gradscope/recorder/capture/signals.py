"""Forward signals that precede instability: attention logits, entropy and sinks, output-logit
log-partition, sub-layer output RMS (docs/signals.md).

- the attention signals (``attn_logit_max``, ``attn_entropy``, ...):
  :mod:`gradscope.recorder.capture.attention_signals`, which says which attention modules are
  recognised and how queries are sampled;
- ``output_logit_log_z``: log Z = logsumexp of the output logits per token, mean (and
  ``output_logit_log_z_max``, max) over tokens (Wortsman et al. 2023 §3.2, z-loss).
- ``sublayer_out_rms``: RMS of each sub-layer (branch) output (Rybakov et al. 2024).

Like the rest of the capture these are hooks installed once and traced by Dynamo: each
writes into a small device buffer in place (running max, sum and count over the step's
forwards and micro-batches), so nothing syncs with the host before the step's one transfer
and nothing is re-run.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gradscope.recorder.capture.attention_signals import QUERIES, AttentionSignals, AttentionValues, allowed_keys, with_kwargs
from gradscope.recorder.discovery.layout import Layout
from gradscope.recorder.numerics.squared_norms import squared_norm
from gradscope.recorder.discovery.sublayer_modules import find_sublayers, sublayer_gaps
from gradscope.recorder.capture.hookset import HookSet
from gradscope.recorder.capture.taps import first_tensor, in_backward

__all__ = ["QUERIES", "Signals", "allowed_keys", "vocab_sizes"]  # (QUERIES, allowed_keys: where they were)


def vocab_sizes(model: nn.Module) -> set[int]:
    """Widths an output must have to be taken for logits: ``config.vocab_size`` when the
    model has one (a HuggingFace classifier's 2 labels are no vocabulary, though its
    token-type table has 2 rows), else the sizes of its embedding tables."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int):
        return {vocab}
    return {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}


class Signals:
    """Hooks and device buffers of the forward signals; owned by the Capture.

    Args:
        model: the recorded model.
        layout: its layout (for sub-layers).
        is_on: whether a recorded step is open (the Capture's flag).
    """

    def __init__(self, model: nn.Module, layout: Layout, is_on) -> None:
        self.model, self.is_on = model, is_on
        self.attention_signals = AttentionSignals(model, is_on)
        self.sublayers = find_sublayers(model, layout)
        self.sublayer_gaps = sublayer_gaps(model, layout)  # (found once: what sublayer_out_rms cannot measure)
        self.vocab = vocab_sizes(model)
        self.want_rms = self.want_logits = False
        self.rms: torch.Tensor | None = None  # (n_sublayers, 2): Σ h², numel
        self.logz: torch.Tensor | None = None  # (3,): Σ log Z, tokens, max log Z
        self.device: torch.device | None = None
        self.outputs = self.outputs_with_logits = 0  # model outputs seen in the step, and those holding logits

    @property
    def attention(self) -> list:
        """The recognised attention modules (:class:`~gradscope.recorder.discovery.attention_modules.Attention`)."""
        return self.attention_signals.attention

    @property
    def unrecognised(self) -> list[str]:
        """Attention-like modules whose q and k cannot be read."""
        return self.attention_signals.unrecognised

    @property
    def unread(self) -> dict[int, str]:
        """Attention index -> why a call of the step was not read."""
        return self.attention_signals.unread

    def install(self, hooks: HookSet, *, attention: bool, rms: bool, logits: bool) -> None:
        """Registers the hooks of the signals a Recorder may record (once per Recorder), so
        a Recorder without them pays nothing for them, in the capture's ``hooks``: armed only
        while a step records, like the capture's own."""
        if attention:
            self.attention_signals.install(hooks)
        for j, (_, m) in enumerate(self.sublayers if rms else ()):
            hooks.forward(m, with_kwargs(self._sublayer(j)))
        if logits:
            hooks.forward(self.model, with_kwargs(self._output))

    def remove(self) -> None:
        """Lets the buffers go (the hooks leave with the capture's HookSet)."""
        self.attention_signals.remove()
        self.rms, self.logz = None, None

    def begin(self, device: torch.device, *, attention: bool, rms: bool, logits: bool) -> None:
        """Arms the hooks for one recorded step and resets the buffers."""
        self.want_rms, self.want_logits = rms, logits
        if attention:
            self.attention_signals.begin(device)
        if self.device != device or self.rms is None:
            self.device = device
            self.rms = torch.zeros(max(len(self.sublayers), 1), 2, device=device)
            self.logz = torch.zeros(3, device=device)
        self.rms.zero_()
        self.logz.zero_()
        self.logz[2] = -math.inf
        self.outputs = self.outputs_with_logits = 0

    def end(self) -> None:
        self.want_rms = self.want_logits = False
        self.attention_signals.end()

    # -- hooks ------------------------------------------------------------------------------
    def _sublayer(self, j: int):
        def hook(module, args, output):
            if not (self.want_rms and self.is_on()) or in_backward():
                return None
            t = first_tensor(output)
            if t is None or not t.is_floating_point():
                return None
            t = t.detach()
            self.rms[j, 0] += squared_norm(t)
            self.rms[j, 1] += t.numel()
            return None

        return hook

    def _output(self, module, args, output):
        if not (self.want_logits and self.is_on()) or in_backward():
            return None
        self.outputs += 1
        t = self._logits_of(output)
        if t is None:
            return None
        self.outputs_with_logits += 1
        log_z = torch.logsumexp(t.detach().float(), dim=-1)
        self.logz[0] += log_z.sum()
        self.logz[1] += log_z.numel()
        self.logz[2] = torch.maximum(self.logz[2], log_z.max())
        return None

    def _logits_of(self, output) -> torch.Tensor | None:
        """The model output's logits: ``output.logits`` (HuggingFace), the output itself, or
        the first item of a tuple whose last dimension is the vocabulary (a model that
        returns ``(loss, logits)`` puts a 0-d loss first); None if there is none."""
        t = getattr(output, "logits", None)
        candidates = [t] if isinstance(t, torch.Tensor) else [output] if isinstance(output, torch.Tensor) else \
            list(output) if isinstance(output, (tuple, list)) else []
        for c in candidates:
            if isinstance(c, torch.Tensor) and c.is_floating_point() and c.dim() >= 1 and c.shape[-1] in self.vocab:
                return c
        return None

    # -- end of step ------------------------------------------------------------------------
    def attention_values(self) -> list[AttentionValues]:
        """Per attention module, its values of the step per head (NaN where no query was seen)."""
        return self.attention_signals.values()

    def rms_values(self) -> torch.Tensor:
        """RMS per sub-layer over the step's forwards (NaN where none was seen)."""
        return torch.where(self.rms[:, 1] > 0, (self.rms[:, 0] / self.rms[:, 1].clamp_min(1)).sqrt(),
                           torch.full_like(self.rms[:, 0], math.nan))

    def logz_values(self) -> torch.Tensor:
        """(mean log Z, max log Z) over the step's tokens (NaN when no logits were seen)."""
        seen = self.logz[1] > 0
        nan = torch.tensor(math.nan, device=self.logz.device)
        return torch.stack([torch.where(seen, self.logz[0] / self.logz[1].clamp_min(1), nan),
                            torch.where(seen, self.logz[2], nan)])

