"""The attention modules whose q and k the attention signals read
(:mod:`gradscope.recorder.capture.signals`), found by what they hold, not by class name; and the
attention-like modules they cannot read."""

from __future__ import annotations

import functools
import inspect
import io
import re
import sys
import textwrap
import tokenize
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Attention:
    """One recognised attention module and how to read its q and k."""

    name: str
    module: nn.Module
    q_src: nn.Module
    k_src: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    causal: bool  # attends causally (``is_causal``; GPT-2's c_attn): a mask passed is combined with the triangle
    causal_known: bool  # the module says whether it is causal (an ``is_causal`` attribute, or GPT-2's fused c_attn)
    fused: bool  # GPT-2: q, k (and v) come out of one projection
    params: tuple[str, ...]  # names of its forward's parameters, to find the mask by name or position
    softcap: float | None = None  # Gemma 2's attn_logit_softcapping: the softmax sees cap·tanh(logit/cap)
    rotary_form: str | None = None  # why the rotary embeddings it is given cannot be applied as HF's rotate_half form
    rotary_inside: bool = False  # its forward applies a rotary embedding of its own (not given as position_embeddings)


def _heads(m: nn.Module) -> int | None:
    for attr in ("n_heads", "num_heads", "num_attention_heads", "n_head"):
        if isinstance(getattr(m, attr, None), int):
            return getattr(m, attr)
    return getattr(getattr(m, "config", None), "num_attention_heads", None)


def _fused_width(m: nn.Module) -> int | None:
    """d of a causal self-attention with one fused q/k/v projection ``c_attn`` and a head
    count (HF GPT-2: ``split_size``, ``num_heads``; nanoGPT: ``n_head``, ``c_attn`` an
    ``nn.Linear`` to 3d), else None."""
    c_attn = getattr(m, "c_attn", None)
    if not isinstance(c_attn, nn.Module) or not isinstance(getattr(m, "num_heads", None) or getattr(m, "n_head", None), int):
        return None
    if isinstance(getattr(m, "split_size", None), int):
        return m.split_size
    out = c_attn.out_features if isinstance(c_attn, nn.Linear) else None
    return out // 3 if out and out % 3 == 0 else None


def find_attention(model: nn.Module) -> list[Attention]:
    """Every attention module of ``model`` whose q and k can be read (see the module docstring)."""
    found = []
    for name, m in model.named_modules():
        params = tuple(inspect.signature(m.forward).parameters)
        q, k = getattr(m, "q_proj", None), getattr(m, "k_proj", None)
        if isinstance(q, nn.Linear) and isinstance(k, nn.Linear) and _heads(m):
            heads = _heads(m)
            config = getattr(m, "config", None)
            kv = getattr(m, "num_key_value_heads", None) or getattr(config, "num_key_value_heads", None) or heads
            dim = getattr(m, "head_dim", None) or q.out_features // heads
            scale = getattr(m, "scaling", None)
            qn, kn = getattr(m, "q_norm", None), getattr(m, "k_norm", None)
            found.append(Attention(
                name, m, qn if isinstance(qn, nn.Module) else q, kn if isinstance(kn, nn.Module) else k, heads, kv,
                dim, float(scale) if isinstance(scale, (int, float)) else dim ** -0.5,
                bool(getattr(m, "is_causal", False)), isinstance(getattr(m, "is_causal", None), bool), False, params,
                _softcap(m), _rotary_form(m, dim), _rotary_inside(m, params)))
        elif (width := _fused_width(m)) and not getattr(m, "is_cross_attention", False):
            heads = getattr(m, "num_heads", None) or m.n_head
            dim = width // heads
            scale = dim ** -0.5 if getattr(m, "scale_attn_weights", True) else 1.0
            if getattr(m, "scale_attn_by_inverse_layer_idx", False):
                scale /= float(getattr(m, "layer_idx", 0) + 1)
            causal = getattr(m, "is_causal", True)  # (GPT-2 says so; a nanoGPT block may say False: bidirectional)
            found.append(Attention(name, m, m.c_attn, m.c_attn, heads, heads, dim, scale,
                                   causal if isinstance(causal, bool) else True, True, True, params,
                                   _softcap(m), None, _rotary_inside(m, params)))
    return found


def _softcap(m: nn.Module) -> float | None:
    """Gemma 2's ``attn_logit_softcapping`` (on the module or its config), else None."""
    cap = getattr(m, "attn_logit_softcapping", None)
    if cap is None:
        cap = getattr(getattr(m, "config", None), "attn_logit_softcapping", None)
    return float(cap) if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0 else None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF Llama's ``rotate_half``: (x₁, x₂) → (−x₂, x₁) over the two halves of the last dimension."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


_ROTARY_FORMS: dict[type, str | None] = {}  # a class's verdict, found once per process


def _rotary_form(m: nn.Module, head_dim: int) -> str | None:
    """None when the ``apply_rotary_pos_emb`` of the module's own source file (HF keeps one in
    each ``modeling_*.py``) gives what :func:`rotate_half`'s form gives, or when there is none
    to ask; else why not (Cohere's and Helium's interleave the pairs: x[..., ::2], x[..., 1::2]).
    Asked once per class, on random q, k, cos and sin."""
    cls = type(m)
    if cls in _ROTARY_FORMS:
        return _ROTARY_FORMS[cls]
    apply = getattr(sys.modules.get(cls.__module__), "apply_rotary_pos_emb", None)
    verdict = None
    if callable(apply) and head_dim % 2 == 0:
        try:
            g = torch.Generator("cpu").manual_seed(0)  # (its own: the global RNG is never drawn from)
            q, k = (torch.randn(1, 2, 3, head_dim, generator=g, device="cpu") for _ in range(2))  # (B, H, T, dh)
            cos, sin = (torch.randn(1, 3, head_dim, generator=g, device="cpu") for _ in range(2))  # (B, T, dh)
            with torch.no_grad():
                q2, k2 = apply(q, k, cos, sin)[:2]
            same = all(isinstance(t, torch.Tensor) and t.shape == x.shape
                       and torch.allclose(t.float(), x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1), atol=1e-5)
                       for t, x in ((q2, q), (k2, k)))
        except Exception:  # (another signature: not the form known here)
            same = False
        if not same:
            verdict = (f"its rotary embeddings are applied in another form than HF Llama's rotate_half "
                       f"({cls.__module__}.apply_rotary_pos_emb: an interleaved one, say)")
    _ROTARY_FORMS[cls] = verdict
    return verdict


_ROTARY_WORDS = re.compile(r"rotary|rope\b|rotate|freqs?_cis|apply_rotary|\bsin\s*\(|\bcos\s*\(")


def _rotary_inside(m: nn.Module, params: tuple[str, ...]) -> bool:
    """Whether an attention that is not given ``position_embeddings=(cos, sin)`` applies a
    rotary embedding of its own between its projections and the softmax (a rotary child
    module, a forward parameter named ``freqs_cis``/``rope``/``rotary...``, or its forward's
    source naming one): then q·k from the projections is not what it computes."""
    if "position_embeddings" in params:
        return False
    if any(_ROTARY_WORDS.search(n.lower()) for n in params):
        return True
    if any(_ROTARY_WORDS.search(n.lower()) for n, _ in m.named_children()):
        return True
    return _forward_names_rotary(type(m))


@functools.lru_cache(maxsize=None)
def _forward_names_rotary(cls: type) -> bool:
    """Whether the code of ``cls.forward`` (not its docstrings or comments: a docstring saying
    "no RoPE" is no rotary) names a rotary embedding; read once per class."""
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        code = " ".join(t.string for t in tokens if t.type not in (tokenize.COMMENT, tokenize.STRING))
    except (OSError, TypeError, SyntaxError, tokenize.TokenError):
        return False
    return bool(_ROTARY_WORDS.search(code.lower()))


def unread_attention(model: nn.Module) -> list[str]:
    """Modules that look like attention but whose q and k :func:`find_attention` cannot
    read: GPT-2's cross-attention (q from ``q_attn``, k from the encoder's states), and
    ``q_proj``/``k_proj`` projections without a head count it knows (``n_head``...)."""
    out = []
    for name, m in model.named_modules():
        q, k = getattr(m, "q_proj", None), getattr(m, "k_proj", None)
        if isinstance(q, nn.Linear) and isinstance(k, nn.Linear) and not _heads(m):
            out.append(name)
        elif _fused_width(m) and getattr(m, "is_cross_attention", False):
            out.append(name)
    return out
