"""The attention signals' capture: hooks on each recognised attention module and on the
modules that make its q and k, and the device buffers they write (owned by
:class:`gradscope.recorder.capture.signals.Signals`; docs/signals.md).

- ``attn_logit_max``: max over allowed positions of the pre-softmax q·k·scale per head
  (Wortsman et al. 2023 §3.1: attention-logit growth; Dehghani et al. 2023).
- ``attn_entropy``: mean over queries of the softmax's entropy per head (Zhai et al. 2023).
- ``attn_sink_mass``: mean over queries of the softmax's probability on key position 0, per
  head (Xiao et al. 2024, attention sinks; Gu et al. 2025, "When attention sink emerges").
- ``attn_softcap_saturation``: where the attention soft-caps its logits (Gemma 2's
  ``attn_logit_softcapping`` c: the softmax sees c·tanh(z/c)), the share of allowed logits z
  with |tanh(z/c)| > ``SOFTCAP_SATURATED`` (0.95), per head: past it the cap passes back
  less than 1 − 0.95² ≈ 10% of the logit's gradient (Gemma Team 2024, §2).

q and k are taken from hooks on the modules that produce them (``q_proj``/``k_proj``, or
``q_norm``/``k_norm`` when the attention normalises them; GPT-2's fused ``c_attn``), never
recomputed from the module's input; the logits of the sampled queries are formed once from
them and every attention quantity reads that one softmax.

Recognised attention modules (by what they hold, not by class name):

- separate ``q_proj``/``k_proj`` linear projections with a head count (``n_heads``,
  ``num_heads`` or ``config.num_attention_heads``): the zoo, HF Llama, Mistral, Qwen2/3,
  Gemma, OLMo 2. Rotary embeddings are applied when the module is called with
  ``position_embeddings=(cos, sin)`` covering the whole head, in HF's ``rotate_half`` form
  (checked once per class against its source file's ``apply_rotary_pos_emb``); grouped-query
  heads are expanded; q/k norms are read before or after the heads' transpose; Gemma 2's
  soft cap is applied for the entropy (the max logit is before it);
- a fused ``c_attn`` with a head count, causal self-attention unless its ``is_causal`` is
  False (HF GPT-2's ``split_size``/``num_heads``; nanoGPT's ``nn.Linear`` to 3d with ``n_head``).

Not recognised (no attention rows; the Recorder warns when the quantity was asked for):
fused ``query_key_value`` projections (GPT-NeoX, Falcon), partial rotary, another rotary form
(Cohere's interleaved pairs), a rotary embedding applied inside a hand-written forward
(:func:`~gradscope.recorder.discovery.attention_modules.find_attention`), x-transformers (rotary
applied inside ``Attend``), ``nn.MultiheadAttention`` (q and k never leave its C++ kernel),
cross-attention in GPT-2 and T5's relative-bias attention.

Masks are read by :func:`allowed_keys` (kinds and shapes there); a module's ``is_causal``
adds the causal triangle; in self-attention a query whose own key is masked (a padded
position) is not counted.

Sampling: the logits of every batch row, head and allowed key are taken for at most
``QUERIES`` queries per sequence, evenly spaced (all of them when T ≤ ``QUERIES``), so the
cost is O(B·H·min(T, QUERIES)·S·d_head) on recorded steps rather than O(B·H·T²·d_head).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from gradscope.recorder.discovery.attention_modules import Attention, find_attention, rotate_half, unread_attention
from gradscope.recorder.capture.hookset import HookSet
from gradscope.recorder.capture.taps import in_backward

QUERIES = 64  # queries sampled per sequence for the attention signals
SOFTCAP_SATURATED = 0.95
"""|tanh(z/c)| above which a soft-capped logit counts as saturated: |z| > c·atanh(0.95) ≈ 1.83·c,
where d(c·tanh(z/c))/dz = 1 − tanh² < 0.0975, the cap passing back under a tenth of the gradient."""

KV_ARGS = ("kv", "key_value_states", "encoder_hidden_states", "memory", "key", "context")
"""Names under which an attention's forward takes the states its keys come from; given and
other than its first input, it is cross-attention (the padded-query rule is self-attention's)."""

MASKED_AT = -1e4  # an additive float mask at or below this masks the key (allowed_keys)

BIDIRECTIONAL = ("it was called without a mask over queries (none, or one of padded keys only) and has no "
                 "is_causal attribute, so whether a query sees the keys after it is not known; set is_causal = True "
                 "(causal) or False (bidirectional) on the module")


def allowed_keys(mask: torch.Tensor | None, B: int, T: int, S: int, idx: torch.Tensor, causal: bool, H: int = 1
                 ) -> torch.Tensor | str:
    """Which keys each sampled query (``idx``, of ``T``) may attend to, broadcastable to
    (B, H, n, S), from the mask the attention was called with, combined with the causal
    triangle when the module attends causally; or why the mask cannot be read.

    A bool mask is True where a query attends, a float mask additive (above half the
    dtype's lowest value: attends), an integer mask 1 where it attends (HF's 2-D
    ``attention_mask``). Shapes: (B, S) a key-padding mask, (T, S) one for every sequence,
    (B, T, S), or 4-D (B or 1, H or 1, T or 1, S). An additive float mask masks where it is
    at most ``MASKED_AT`` (-1e4: BERT's ``(1 - mask) * -10000``, ``-1e9``, ``finfo.min``,
    ``-inf``); larger negatives are biases the query still attends through (ALiBi's, up to
    distances of ~10⁴ tokens).
    """
    device = idx.device
    def triangle() -> torch.Tensor:  # (n, S): keys up to each sampled query (a cache's S - T earlier keys too)
        return torch.arange(S, device=device) <= (idx + (S - T)).unsqueeze(-1)

    if mask is None:
        return triangle() if causal else torch.ones(idx.numel(), S, dtype=torch.bool, device=device)
    shape = tuple(mask.shape)
    if mask.dim() == 2:
        padding, queries = shape[0] == B and shape[0] != T, shape[0] == T and shape[0] != B  # (no bool == bool:
        if shape[-1] != S or not (padding or queries):  # Dynamo's dynamic shapes make these SymBools)
            return ("its 2-D mask is neither a key-padding mask (batch, keys) nor a (queries, keys) mask, or could be "
                    "either (as many sequences as queries)")
        m = mask[:, None, None, :] if padding else mask[None, None]
    elif mask.dim() == 3 and shape[0] in (1, B) and shape[1] in (1, T) and shape[2] == S:
        m = mask[:, None]
    elif mask.dim() == 4 and shape[0] in (1, B) and shape[1] in (1, H) and shape[2] in (1, T) and shape[3] == S:
        m = mask
    else:
        return "its mask's shape fits none of (B, S), (T, S), (B, T, S) or (B, H, T, S)"
    if m.shape[-2] == T and T > 1:
        m = m[..., idx, :]
    if m.dtype == torch.bool:
        ok = m
    elif m.is_floating_point():
        ok = m > MASKED_AT
    else:
        ok = m != 0
    return ok & triangle() if causal else ok


def _heads_first(q: torch.Tensor, q_in: torch.Tensor | None, heads: int, T) -> bool | None:
    """Whether a 4-D q (a q_norm's output) is (B, H, T, dh) rather than (B, T, H, dh): by its
    shape when the query count ``T`` (the attention's input's) tells, else by its norm's input,
    whose head dimension is the inner one (stride dh) when it is a view of the projection
    (Qwen 3 norms before the transpose, Gemma 3 after it); None when neither tells."""
    a, b = q.shape[1], q.shape[2]
    if T is not None and (a, b) == (T, heads) and (b, a) != (T, heads):
        return False
    if T is not None and (a, b) == (heads, T) and (b, a) != (heads, T):
        return True
    if a == b == 1:
        return False  # (one token and one head: both layouts are the same)
    if isinstance(q_in, torch.Tensor) and q_in.dim() == 4 and q_in.shape == q.shape and q_in.stride(1) != q_in.stride(2):
        return q_in.stride(1) < q_in.stride(2)
    return None



class AttentionValues(NamedTuple):
    """One attention module's values of a step, each per head (H,); NaN where no query was seen."""

    logit_max: torch.Tensor
    entropy: torch.Tensor
    sink_mass: torch.Tensor
    softcap_saturation: torch.Tensor  # NaN throughout where the module has no soft cap


class AttentionSignals:
    """Hooks and device buffers of the attention signals.

    Args:
        model: the recorded model.
        is_on: whether a recorded step is open (the Capture's flag).
    """

    def __init__(self, model: nn.Module, is_on) -> None:
        self.is_on = is_on
        self.attention = find_attention(model)
        self.unrecognised = unread_attention(model)  # attention-like modules whose q and k cannot be read
        self.want = False
        # per module (H, 6): running max logit, entropy sum, query count, sink-probability sum, saturated logits,
        # soft-capped logits
        self.attn: list[torch.Tensor] = []
        self._calls: dict[int, dict] = {}  # attention index -> {"mask", "rope", "q", "k"} of the call in progress
        # attention index -> why a call of the step was not read (a mask or rotary layout not understood),
        # or that it was read as bidirectional for want of a mask and of an ``is_causal`` attribute
        self.unread: dict[int, str] = {}
        self.device: torch.device | None = None

    def install(self, hooks: HookSet) -> None:
        """Registers the attention hooks (once per Recorder) in the capture's ``hooks``."""
        for i, a in enumerate(self.attention):
            hooks.forward_pre(a.module, self._attn_pre(i))
            if a.fused:
                hooks.forward(a.q_src, with_kwargs(self._qk(i, "qkv")))
            else:
                hooks.forward(a.q_src, with_kwargs(self._qk(i, "q")))
                hooks.forward(a.k_src, with_kwargs(self._qk(i, "k")))
            hooks.forward(a.module, with_kwargs(self._attn_post(i)))

    def remove(self) -> None:
        """Lets the buffers go."""
        self.attn, self._calls, self.device = [], {}, None

    def begin(self, device: torch.device) -> None:
        """Arms the hooks for one recorded step and resets the buffers."""
        self.want = True
        if self.device != device or len(self.attn) != len(self.attention):
            self.device = device
            self.attn = [torch.zeros(a.heads, 6, device=device) for a in self.attention]
        for buf in self.attn:
            buf.zero_()
            buf[:, 0] = -math.inf
        self._calls = {}
        self.unread = {}

    def end(self) -> None:
        self.want = False
        self._calls = {}

    # -- hooks ------------------------------------------------------------------------------
    def _attn_pre(self, i: int):
        a = self.attention[i]

        def hook(module, args, kwargs):
            if not (self.want and self.is_on()) or in_backward():
                return None
            named = dict(zip(a.params, args))
            named.update(kwargs)
            mask = named.get("attention_mask", named.get("mask", named.get("attn_mask")))
            rope = named.get("position_embeddings")
            first = next(iter(named.values()), None)
            other = next((named[n] for n in KV_ARGS if isinstance(named.get(n), torch.Tensor)), None)
            self._calls[i] = {"mask": mask if isinstance(mask, torch.Tensor) else None,
                              "self": other is None or other is first,  # (keys and values from its own input)
                              "rope": rope if isinstance(rope, (tuple, list)) and len(rope) == 2 else None,
                              "rope_other": rope is not None and not (isinstance(rope, (tuple, list)) and len(rope) == 2),
                              "T": first.shape[1] if isinstance(first, torch.Tensor) and first.dim() == 3 else None}
            return None

        return hook

    def _qk(self, i: int, which: str):
        def hook(module, args, output):
            call = self._calls.get(i)
            if call is not None and isinstance(output, torch.Tensor):
                call[which] = output.detach()
                call[f"{which}_in"] = args[0] if args else None  # (a projection's input: q and k of one input?)
            return None

        return hook

    def _attn_post(self, i: int):
        a = self.attention[i]

        def hook(module, args, output):
            call = self._calls.pop(i, None)
            if call is None:
                return None
            if a.fused and "qkv" in call:
                q, k, _ = call["qkv"].split(a.heads * a.head_dim, dim=-1)
            elif "q" in call and "k" in call:
                q, k = call["q"], call["k"]
            else:
                return None
            projections = isinstance(a.q_src, nn.Linear) and isinstance(a.k_src, nn.Linear)  # (not q_norm/k_norm)
            own = not projections or call.get("q_in") is call.get("k_in")
            if q.dim() == 4:  # (q_norm/k_norm's output: (B, T, H, dh), or (B, H, T, dh) when normed after the transpose)
                heads_first = _heads_first(q, call.get("q_in"), a.heads, call["T"])
                if heads_first is None:
                    self.unread[i] = "the layout of its normalised q and k (batch, tokens, heads, head dim) is not known"
                    return None
                if heads_first:  # (Gemma 3: q_norm after .transpose(1, 2))
                    q, k = q.transpose(1, 2), k.transpose(1, 2)
            if call["rope_other"]:  # (Llama 4 passes one complex freqs_cis tensor)
                self.unread[i] = "its position_embeddings are not a (cos, sin) pair, so its rotary form is not known"
                return None
            self._attention_stats(i, a, self.attn[i], q, k, call["mask"], call["rope"], a.fused or (call["self"] and own))
            return None

        return hook

    def _attention_stats(self, i: int, a: Attention, buf: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         mask: torch.Tensor | None, rope, self_attention: bool) -> None:
        B, T = q.shape[0], q.shape[1]
        S = k.shape[1]
        if a.rotary_inside:
            self.unread[i] = ("its forward applies a rotary embedding of its own (not given as position_embeddings=(cos, "
                              "sin)), so q·k from its projections is not what it computes")
            return
        if rope is not None and a.rotary_form is not None:
            self.unread[i] = a.rotary_form
            return
        if q.numel() != B * T * a.heads * a.head_dim or k.numel() != B * S * a.kv_heads * a.head_dim:
            self.unread[i] = (f"its q {tuple(q.shape)} and k {tuple(k.shape)} do not split into {a.heads} and "
                              f"{a.kv_heads} heads of {a.head_dim} (a tensor-parallel plan that gives each rank some "
                              "of its heads, or a projection of another shape)")
            return
        q = q.reshape(B, T, a.heads, a.head_dim)
        k = k.reshape(B, S, a.kv_heads, a.head_dim)
        n = min(T, QUERIES)
        idx = torch.arange(n, device=q.device) * T // n  # evenly spaced queries
        q = q[:, idx].transpose(1, 2).float()  # (B, H, n, dh)
        k = k.transpose(1, 2).float()  # (B, Hkv, S, dh)
        if rope is not None:
            cos, sin = rope
            if cos.shape[-1] != a.head_dim or cos.shape[-2] != S:
                self.unread[i] = "its rotary embeddings cover part of the head only (partial rotary)"
                return
            cos, sin = cos.float().unsqueeze(1), sin.float().unsqueeze(1)  # (B, 1, T, dh)
            q = q * cos[:, :, idx] + rotate_half(q) * sin[:, :, idx]
            k = k * cos + rotate_half(k) * sin
        if a.kv_heads != a.heads:
            k = k.repeat_interleave(a.heads // a.kv_heads, dim=1)
        logits = (q @ k.transpose(-1, -2)) * a.scale  # (B, H, n, S)
        allowed = allowed_keys(mask, B, T, S, idx, a.causal, a.heads)
        if isinstance(allowed, str):
            self.unread[i] = allowed
            return
        if not a.causal_known and (mask is None or mask.dim() == 2 and mask.shape[0] == B or mask.shape[-2] == 1):
            self.unread[i] = BIDIRECTIONAL  # (no mask over queries, and causality not said: which keys count is unknown)
            return
        if self_attention and S == T:  # a query whose own key is masked is a padded position, not counted
            allowed = allowed.expand(*allowed.shape[:-2], idx.numel(), S)
            allowed = allowed & allowed[..., torch.arange(idx.numel(), device=idx.device), idx].unsqueeze(-1)
        allowed = allowed.expand(logits.shape)
        masked = logits.masked_fill(~allowed, -math.inf)
        top = masked.amax(dim=(0, 2, 3))  # (H,): the logit before any soft cap
        valid = allowed.any(dim=-1)  # (B, H, n): queries with at least one allowed key
        if a.softcap is not None:  # (Gemma 2: its softmax sees cap·tanh(logit/cap))
            masked = (torch.tanh(logits / a.softcap) * a.softcap).masked_fill(~allowed, -math.inf)
        p = torch.softmax(masked, dim=-1).nan_to_num(0.0)
        entropy = torch.special.entr(p).sum(dim=-1)  # (B, H, n)
        buf[:, 0] = torch.maximum(buf[:, 0], top)
        buf[:, 1] += (entropy * valid).sum(dim=(0, 2))
        buf[:, 2] += valid.sum(dim=(0, 2)).float()
        buf[:, 3] += (p[..., 0] * valid).sum(dim=(0, 2))  # the mass on key position 0 (a sink)
        if a.softcap is not None:
            saturated = (torch.tanh(logits / a.softcap).abs() > SOFTCAP_SATURATED) & allowed
            buf[:, 4] += saturated.sum(dim=(0, 2, 3)).float()
            buf[:, 5] += allowed.sum(dim=(0, 2, 3)).float()

    # -- end of step ------------------------------------------------------------------------
    def values(self) -> list[AttentionValues]:
        """Per attention module, its values of the step (NaN where no query was seen)."""
        out = []
        for buf in self.attn:
            seen = buf[:, 2] > 0
            nan = torch.full_like(buf[:, 0], math.nan)
            queries = buf[:, 2].clamp_min(1)
            out.append(AttentionValues(torch.where(seen, buf[:, 0], nan), torch.where(seen, buf[:, 1] / queries, nan),
                                       torch.where(seen, buf[:, 3] / queries, nan),
                                       torch.where(buf[:, 5] > 0, buf[:, 4] / buf[:, 5].clamp_min(1), nan)))
        return out


def with_kwargs(hook):
    """A forward hook ``hook(module, args, output)`` as one that is also given the kwargs
    (the HookSet registers every hook with ``with_kwargs=True``)."""

    def hook_with_kwargs(module, args, kwargs, output):
        return hook(module, args, output)

    return hook_with_kwargs
